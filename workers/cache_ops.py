"""The cache calls an operator makes of a worker (flush, purge, tenants' quotas and sessions,
peer counters): methods of the worker's Ray actor (`workers.actor.WorkerActor`), kept apart
from its serving calls. Each runs between steps, or off the loop where it blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.protocol import TenantBlocks, TenantQuota

if TYPE_CHECKING:
    from workers.engine.async_engine import AsyncEngine


class CacheOps:
    """Mixed into the actor, which sets `_engine`."""

    _engine: AsyncEngine

    async def flush(self) -> int:
        """Drop every cached device block no running request uses, without demoting it to the
        lower tiers (`Engine.flush`); returns how many were dropped."""
        return await self._engine.call(lambda e: e.flush())

    async def purge(self) -> dict[str, int]:
        """Drop everything this worker holds in every tier, this model's Redis blocks included
        (`Engine.purge`); returns how many blocks each tier dropped, by tier name."""
        return await self._engine.run_exclusive(lambda e: e.purge())

    async def set_quotas(self, quotas: dict[str, TenantQuota]) -> None:
        """Tenants' soft shares and retention budgets, in every tier (`CacheAdmin`)."""
        await self._engine.call(lambda e: e.cache_admin.set_quotas(quotas))

    async def close_session(self, tenant: str, session_id: str) -> int:
        """End the retentions of a tenant's session in every tier; returns how many blocks."""
        return await self._engine.call(lambda e: e.cache_admin.close_session(tenant, session_id))

    async def tenant_usage(self) -> dict[str, dict[str, TenantBlocks]]:
        """Per tier name, each tenant's cached and retained blocks."""
        return await self._engine.call(lambda e: e.cache_admin.tenant_blocks())

    async def peer_stats(self) -> dict[str, int]:
        """Blocks landed from peers, and pulls whose peer did not answer (computed instead)."""
        tiering = self._engine.engine.tiering
        stats = None if tiering is None or tiering.peers is None else tiering.peers.stats
        return {
            "pulled_blocks": 0 if stats is None else stats.pulled_blocks,
            "pull_failures": 0 if stats is None else stats.failures,
        }
