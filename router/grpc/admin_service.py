"""cachesvc.v1.Admin: the workers' state, statistics, flush and purge, the tenants' quotas and
usage. The operator's token only (`router.auth`): these act on every tenant."""

from __future__ import annotations

from typing import Any

import grpc

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.core import Router
from router.domain import InvalidInput, TenantUsage
from router.grpc import wire
from router.grpc.calls import decoded, fail
from router.tenants import TENANT_NAME, TenantLimits


class AdminService:
    """cachesvc.v1.Admin."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def list_workers(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        await decoded(request, context)
        return pb.ListWorkersResponse(
            workers=[wire.worker_to_proto(w) for w in self._router.workers()]
        )

    async def stats(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await decoded(request, context)
        return wire.stats_to_proto(self._router.stats())

    async def flush(self, request: Any, context: grpc.aio.ServicerContext) -> pb.FlushResponse:
        await decoded(request, context)
        try:
            dropped = await self._router.flush()
        except Exception as exc:
            await fail(context, exc)
        return pb.FlushResponse(num_blocks_dropped=dropped)

    async def purge(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PurgeResponse:
        await decoded(request, context)
        try:
            purged = await self._router.purge()
        except Exception as exc:
            await fail(context, exc)
        return pb.PurgeResponse(num_blocks_purged=purged)

    async def set_tenant_quota(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SetTenantQuotaResponse:
        msg: pb.SetTenantQuotaRequest = await decoded(request, context)
        try:
            tenant, limits = quota_from_proto(msg)
            await self._router.set_quota(tenant, limits)
        except Exception as exc:
            await fail(context, exc)
        return pb.SetTenantQuotaResponse(quota=quota_to_proto(tenant, limits))

    async def tenant_usage(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.TenantUsageResponse:
        await decoded(request, context)
        try:
            usage = await self._router.tenant_usage()
        except Exception as exc:
            await fail(context, exc)
        return self._usage_to_proto(usage)

    def _usage_to_proto(self, usage: list[TenantUsage]) -> pb.TenantUsageResponse:
        """Every tenant that holds blocks or has limits of its own, by name."""
        by_tenant = {u.tenant: u.tiers for u in usage}
        tenants = sorted(set(by_tenant) | set(self._router.quotas.entries()))
        return pb.TenantUsageResponse(
            tenants=[
                pb.TenantUsageEntry(
                    quota=quota_to_proto(t, self._router.quotas.limits(t)),
                    tiers={
                        tier: pb.TenantTierUsage(cached=cached, retained=retained)
                        for tier, (cached, retained) in by_tenant.get(t, {}).items()
                    },
                )
                for t in tenants
            ]
        )


def quota_from_proto(msg: pb.SetTenantQuotaRequest) -> tuple[str, TenantLimits]:
    """The tenant and limits a SetTenantQuota asks; InvalidInput naming the field."""
    if not msg.HasField("quota"):
        raise InvalidInput("quota must be set: tenant, share, max_retention_s, retention_share")
    q = msg.quota
    if q.tenant and not TENANT_NAME.fullmatch(q.tenant):
        raise InvalidInput(
            f"quota.tenant {q.tenant[:80]!r} must be 1-64 characters of A-Z a-z 0-9 _ . - "
            "(or empty: the requests without a tenant's token)"
        )
    try:
        limits = TenantLimits(q.share, q.max_retention_s, q.retention_share)
    except ValueError as exc:  # names share, max_retention or retention_share
        raise InvalidInput(
            f"quota.{str(exc).replace('max_retention ', 'max_retention_s ')}"
        ) from exc
    return q.tenant, limits


def quota_to_proto(tenant: str, limits: TenantLimits) -> pb.TenantQuota:
    return pb.TenantQuota(
        tenant=tenant,
        share=limits.share,
        max_retention_s=limits.max_retention_s,
        retention_share=limits.retention_share,
    )
