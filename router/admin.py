"""The calls over every worker: what each holds, flush and purge, the tenants' quotas and
usage (`Admin`), and closing a cache session (`Cache.CloseSession`).

The router (`core.Router`) delegates here; the gRPC servicer reaches them through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from cachesvc.kv.types import WorkerId
from router.domain import TenantUsage, Unavailable, WorkerStatus
from router.pool.worker_errors import WorkerDied
from router.pool.worker_pool import WorkerPool
from router.pool.worker_state import Health
from router.response_cache.cache import ResponseCache
from workers.protocol import TenantBlocks, TenantQuota


def worker_statuses(pool: WorkerPool) -> list[WorkerStatus]:
    """Each worker's health, load and indexed blocks, as Admin.ListWorkers reports them."""
    return [
        WorkerStatus(
            worker_id=s.worker_id,
            health=s.health.value,
            num_running=s.load.num_running,
            num_waiting=s.load.num_waiting,
            num_queued_tokens=s.load.num_queued_tokens,
            blocks={t: (b.total, b.used, b.cached) for t, b in s.load.blocks.items()},
            num_inflight=s.num_inflight,
            num_indexed_blocks=pool.index.num_blocks(s.worker_id),
            role=s.info.role if s.info is not None else "",
        )
        for s in pool.states()
    ]


async def flush_workers(pool: WorkerPool, responses: ResponseCache | None) -> int:
    """Drop every unused cached block from every live worker's device pool (not moved to
    its lower tiers); returns how many."""
    dropped = 0
    for state in pool.states():
        if state.health is Health.DEAD:
            continue
        with contextlib.suppress(WorkerDied):
            dropped += int(await pool.call(state.worker_id, "flush"))
            await pool.sync(state.worker_id)
    if responses is not None:
        await responses.clear()
    return dropped


async def purge(pool: WorkerPool, responses: ResponseCache | None) -> dict[str, int]:
    """Make everything cached so far unreachable at once, then drop it; blocks per tier.

    First a new purge epoch (in the index, so routers sharing it agree): every request
    that arrives from then on hashes its blocks anew, so no worker, peer or shared tier
    can serve an old block, not even one a request already under way caches after its
    worker was purged. Then every live worker drops what it holds in every tier (to free
    the room), and the response cache is emptied. Raises Unavailable, purging nothing,
    when the epoch cannot be stored."""
    try:
        pool.index.advance_purge_epoch()
    except ConnectionError as exc:
        raise Unavailable(f"{exc}; nothing was purged, retry") from exc
    purged: dict[str, int] = {}
    for state in pool.states():
        if state.health is Health.DEAD:
            continue
        with contextlib.suppress(WorkerDied):
            counts = await pool.call(state.worker_id, "purge")
            for tier, num in counts.items():
                purged[tier] = purged.get(tier, 0) + int(num)
            await pool.sync(state.worker_id)
    if responses is not None:
        purged["response"] = await responses.clear()
    return purged


async def _each_live(
    pool: WorkerPool, method: str, *args: Any
) -> AsyncIterator[tuple[WorkerId, Any]]:
    """`method(*args)` on every live worker, one after another; a worker that dies meanwhile
    is skipped (it holds nothing any more)."""
    for state in pool.states():
        if state.health is Health.DEAD:
            continue
        with contextlib.suppress(WorkerDied):
            yield state.worker_id, await pool.call(state.worker_id, method, *args)


async def close_session(pool: WorkerPool, tenant: str, session_id: str) -> int:
    """Demote every block `tenant`'s session retained, on every live worker; how many."""
    return sum([int(n) async for _, n in _each_live(pool, "close_session", tenant, session_id)])


async def push_quotas(pool: WorkerPool, quotas: dict[str, TenantQuota]) -> int:
    """Make `quotas` the pool's (given to every worker that joins) and give them to every live
    worker now; how many took them."""
    pool.quotas = dict(quotas)
    return len([w async for w, _ in _each_live(pool, "set_quotas", dict(quotas))])


async def tenant_usage(pool: WorkerPool) -> list[TenantUsage]:
    """Each tenant's blocks per tier, summed over the live workers, by tenant name."""
    sums: dict[str, dict[str, tuple[int, int]]] = {}
    async for _, by_tier in _each_live(pool, "tenant_usage"):
        tiers: dict[str, dict[str, TenantBlocks]] = by_tier
        for tier, by_tenant in tiers.items():
            for tenant, blocks in by_tenant.items():
                cached, retained = sums.setdefault(tenant, {}).get(tier, (0, 0))
                sums[tenant][tier] = (cached + blocks.cached, retained + blocks.retained)
    return [TenantUsage(tenant, tiers) for tenant, tiers in sorted(sums.items())]
