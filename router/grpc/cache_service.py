"""cachesvc.v1.Cache: explicit cache control of a tenant's own prompts (Prewarm, CloseSession).

A tenant's token suffices, and acts on its own tenant only: a prewarm is hashed under the
tenant's salt (as its Generate calls are) and counts against its quota; a session closed is the
tenant's session of that id, never another tenant's of the same id.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import grpc

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.auth import TokenTable, tenant_cache_salt
from router.core import Router
from router.domain import InvalidInput
from router.grpc import wire
from router.grpc.calls import caller_tenant, decoded, fail, status_of
from router.request.cache_hints import check_session_id


class CacheService:
    """cachesvc.v1.Cache."""

    def __init__(self, router: Router, tokens: TokenTable | None) -> None:
        self._router = router
        self._tokens = tokens

    async def prewarm(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PrewarmResponse:
        msg: pb.PrewarmRequest = await decoded(request, context)
        try:
            inp = wire.prewarm_from_proto(msg)
            tenant = caller_tenant(self._tokens, context)
            inp = dataclasses.replace(
                inp,
                request_id=f"prewarm-{uuid.uuid4().hex[:16]}",
                cache_salt=tenant_cache_salt(tenant, inp.cache_salt),
                tenant=tenant or "",
            )
            result = await self._router.prewarm(inp)
        except Exception as exc:
            self._count("Prewarm", status_of(exc))
            await fail(context, exc)
        self._count("Prewarm", grpc.StatusCode.OK)
        return wire.prewarm_to_proto(result)

    async def close_session(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        msg: pb.CloseSessionRequest = await decoded(request, context)
        try:
            session = check_session_id(msg.session_id)
            if session is None:
                raise InvalidInput("session_id must not be empty")
            tenant = caller_tenant(self._tokens, context) or ""
            released = await self._router.close_session(tenant, session)
        except Exception as exc:
            self._count("CloseSession", status_of(exc))
            await fail(context, exc)
        self._count("CloseSession", grpc.StatusCode.OK)
        return pb.CloseSessionResponse(num_blocks_released=released)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self._router.metrics.requests.labels("grpc", method, code.name).inc()
