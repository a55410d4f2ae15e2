"""How busy an engine is (`EngineLoad`), measured at a step boundary by `measure_load`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.engine.engine import Engine


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is. The counts of requests and blocks are those of the last change
    between steps; `num_queued_tokens` and `tiering` are measured at the last step boundary
    (off the event loop: the walk over every request's cached prefix is not free).

    `num_queued_tokens` counts tokens that still need a forward pass (prompt tokens not yet
    computed, plus one per decoding request): the work ahead of a newly arrived request. A
    waiting request's prefix already in the device pool is not work, nor what a planned fetch (from
    a tier, a peer) is to bring: both are left out, so a worker queueing cache hits does not look
    busier than it is.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    tiering: Mapping[str, float] = field(default_factory=dict)  # KVTiering.metrics()


def measure_load(engine: Engine) -> EngineLoad:
    """The engine's load now; walks every request's cached prefix (call it off the event loop)."""
    requests = [*engine.scheduler.waiting, *engine.scheduler.running]
    tiering: dict[str, float] = {}
    if engine.tiering is not None:
        # Demotions lost to a failing eviction hook are counted by the pool, not the tiers.
        tiering = {**engine.tiering.metrics(), "demote_failed": engine.pool.num_evict_hook_failures}
    return EngineLoad(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_queued_tokens=sum(
            r.num_tokens - r.num_computed_tokens - engine.kv.num_free_tokens(r) for r in requests
        ),
        num_blocks=engine.pool.num_blocks,
        num_free_blocks=engine.pool.num_free,
        num_cached_blocks=engine.pool.num_cached,
        tiering=tiering,
    )
