"""What a worker actor reports besides its streams: its load (`WorkerLoad`) and the block hashes
it holds (`IndexSnapshot`), built from the engine's state. Plain translation, no state: the actor
(`workers.actor`) stays a thin edge."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from cachesvc.kv.events import TIER_HBM
from cachesvc.kv.index import IndexSnapshot
from cachesvc.kv.types import BlockId
from workers.protocol import TierBlocks, WorkerLoad

if TYPE_CHECKING:
    from workers.engine.engine import Engine
    from workers.engine.load import EngineLoad
    from workers.engine.tiering.kv_tiering import KVTiering


def index_snapshot(engine: Engine, incarnation: str) -> IndexSnapshot:
    """Every block hash `engine` holds, per tier, as of its event log's next number. Run it
    between steps, once the events so far are collected (the snapshot follows them)."""
    pool = engine.pool
    held = (pool.block_hash(BlockId(i)) for i in range(pool.num_blocks))
    blocks = {TIER_HBM: tuple(h for h in held if h is not None)}
    if engine.tiering is not None:  # the lower tiers too: a resync must not forget them
        for tier, hashes in engine.tiering.manager.held_by_tier().items():
            blocks[tier] = tuple(hashes)
    return IndexSnapshot(incarnation, pool.events.next_seq, blocks)


def worker_load(
    load: EngineLoad, tiering: KVTiering | None, counters: Mapping[str, float]
) -> WorkerLoad:
    """The worker's load from the engine's `load` (as of its last step boundary), with the
    tiers' counters and `counters` (the peer exporter's and prefetcher's) merged in. Never
    waits for a step: the tiers' block costs are a snapshot."""
    hbm = TierBlocks(
        total=load.num_blocks,
        used=load.num_blocks - load.num_free_blocks,
        cached=load.num_cached_blocks,
    )
    costs = None if tiering is None else tiering.block_costs()
    return WorkerLoad(
        load.num_running,
        load.num_waiting,
        load.num_queued_tokens,
        {TIER_HBM: hbm},
        {**load.tiering, **counters},
        costs,
    )
