"""Putting fetched blocks on the device: written into a request's blocks and registered in the
pool (`land_blocks`), the blocks allocated for what did not arrive given back (`trim_blocks`),
and the tiers' memory lent for a read that lands at once (`borrowed`).

`KVTiering` decides what lands where and keeps the counts; these only touch the device caches,
the pool and the request's block table, on the engine's thread.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.codec import KVBlock
from cachesvc.kv.tiers.tier_manager import TierManager
from workers.engine.kv_copy import write_registered
from workers.engine.request import Request
from workers.engine.tiering.pending_loads import Ranges


def land_blocks(
    kv_caches: list[torch.Tensor],
    pool: BlockPool,
    request: Request,
    blocks: list[KVBlock],
    first: int,
    block_size: int,
    dtype: str,
) -> float:
    """Write `blocks` into the request's blocks from index `first`, register them under their
    hashes, mark the lossy ones (`BlockPool.mark_lossy`; a block whose hash another holds
    stays the request's own, marked all the same) and move the request's computed tokens past
    them. Returns the seconds the copy into the device caches took (what the cost model learns;
    registering is not counted)."""
    n = len(blocks)
    ids = request.block_ids[first : first + n]
    land_s = write_registered(
        kv_caches,
        pool,
        ids,
        blocks,
        range(first, first + n),
        request.all_token_ids,
        request.block_hashes,
        block_size,
        dtype,
    )
    request.num_computed_tokens = (first + n) * block_size
    return land_s


def trim_blocks(pool: BlockPool, request: Request, block_size: int) -> None:
    """Give back blocks allocated for a fetch that did not land (computed tokens decide)."""
    keep = -(-request.num_computed_tokens // block_size)
    extra = request.block_ids[keep:]
    if extra:
        pool.free(list(reversed(extra)))
        del request.block_ids[keep:]


def borrowed(manager: TierManager, ranges: Ranges) -> ExitStack:
    """Borrow the tiers of `ranges` that lend views of their memory (DRAM's slots, NVMe's read
    arena) until exit: a read inside lands without copying into fresh buffers first."""
    stack = ExitStack()
    for name in sorted({name for name, _ in ranges}):
        borrow = getattr(manager.tier(name), "borrow", None)
        if borrow is not None:
            stack.enter_context(borrow())
    return stack
