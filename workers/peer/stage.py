"""What a holder does with its engine for a chunk: find the run, pin it, copy it, seal it.

At a step boundary (`AsyncEngine.call`), `pin_run` finds the leading run of a prompt's blocks
this worker holds — the device pool's, then what its local tiers hold after it (read there) —
and pins the device blocks: a reference each, so nothing evicts or reuses them, and since a full
cached block is never written again, they can be copied while the engine steps on. `copy_run`
then gathers them, in one batched gather, into the chunk's staging room `[num_blocks, layers,
...]` on a transfer thread, off the engine's loop; `unpin` gives the references back at a later
boundary. `seal` (the digest) runs on a thread too. `stage_run` does all three at once, for a
caller that is between steps anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cachesvc.kv.codec import KVBlock
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.kv_copy import gather_blocks, kv_to_numpy
from workers.transfer.chunk import KVChunk, chunk_digest

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.engine import Engine


@dataclass(frozen=True)
class PinnedRun:
    """A run found at a step boundary: its device blocks pinned, then the rows the local tiers
    held after them (already read)."""

    start_block: int
    dtype: str
    device: tuple[BlockId, ...]
    tier_rows: tuple[np.ndarray, ...]
    hashes: tuple[BlockHash, ...]
    lossy: bool

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.tier_rows)

    @property
    def end_block(self) -> int:
        return self.start_block + self.num_blocks


@dataclass(frozen=True)
class StagedRun:
    """A run of blocks copied out of the engine, not yet sealed."""

    start_block: int
    dtype: str
    payload: np.ndarray  # [num_blocks, layers, ...], the cache's storage dtype, owned
    hashes: tuple[BlockHash, ...]
    lossy: bool = False


def prompt_hashes(
    engine: Engine, token_ids: Sequence[int], cache_salt: str | None
) -> list[BlockHash]:
    """The hashes of a prompt's full blocks under `cache_salt`, as the engine's own requests
    compute them."""
    bs = engine.config.block_size
    root = root_hash(engine.loaded.fingerprint, bs, cache_salt or "")
    return hash_blocks(list(token_ids), bs, root)


def held_in_tier(engine: Engine, hashes: Sequence[BlockHash], i: int) -> KVBlock | None:
    """Block `i` of a chain from a local tier (DRAM, NVMe: not the shared Redis tier, which
    the puller reads itself), else None."""
    tiering = engine.tiering
    if tiering is None:
        return None
    local = {t.name for t in tiering.manager.local}
    held = [name for name in tiering.manager.held_locally(hashes[i]) if name in local]
    if not held:
        return None
    result = tiering.manager.read([(held[0], [hashes[i]])])
    tiering.manager.settle(result)
    return result.blocks[0] if result.blocks else None


def block_shape(engine: Engine) -> tuple[int, ...]:
    """One block's KV across the layers, as the engine's caches hold it."""
    caches = engine.runner.kv_caches
    return (len(caches), *caches[0].shape[1:])


def staging_buffer(engine: Engine, max_bytes: int) -> torch.Tensor:
    """A host buffer for runs of at most `max_bytes` (one block at least), in the caches'
    dtype: pinned when the caches are on a GPU, so the gather's copy to the host is one DMA."""
    caches = engine.runner.kv_caches
    shape = block_shape(engine)
    per_block = int(np.prod(shape)) * caches[0].element_size()
    num = max(1, max_bytes // per_block)
    return torch.empty((num, *shape), dtype=caches[0].dtype, pin_memory=caches[0].is_cuda)


def pin_run(
    engine: Engine,
    token_ids: Sequence[int],
    cache_salt: str | None,
    start_block: int,
    end_block: int,
    max_blocks: int,
    hashes: Sequence[BlockHash] | None = None,
) -> PinnedRun:
    """The run of blocks `start_block .. end_block - 1` of a prompt under `cache_salt` this
    engine holds, up to the first it lacks and at most `max_blocks`: its device blocks pinned
    (give them back with `unpin`), the rows its local tiers hold after them read. `hashes`:
    the prompt's under `cache_salt`, when the caller has them already. Run it between steps."""
    if hashes is None:
        hashes = prompt_hashes(engine, token_ids, cache_salt)
    hashes = hashes[: max(0, end_block)]
    first = max(0, start_block)
    end = min(len(hashes), first + max_blocks)
    device = _device_run(engine, hashes, token_ids, first, end)
    engine.pool.touch(device)
    # Lossy KV (dequantized, or computed over it) travels marked: the puller lands it marked,
    # so it never reaches a lossless tier there either.
    lossy = engine.pool.any_lossy(device)
    rows: list[np.ndarray] = []
    for i in range(first + len(device), end):
        block = held_in_tier(engine, hashes, i)
        if block is None:
            break
        rows.append(block.array)
        lossy = lossy or block.lossy
    run = tuple(hashes[first : first + len(device) + len(rows)])
    return PinnedRun(first, engine.config.dtype, tuple(device), tuple(rows), run, lossy)


@torch.inference_mode()
def copy_run(kv_caches: Sequence[torch.Tensor], run: PinnedRun, buffer: torch.Tensor) -> StagedRun:
    """Copy a pinned run into `buffer` (`staging_buffer`, or a slot's view): its device blocks
    in one gather, then its tier rows. Reads only the pinned blocks, so it may run beside a
    step. The run's payload is a view of `buffer`."""
    num_device = len(run.device)
    if num_device:
        gather_blocks(kv_caches, run.device, buffer[:num_device])
    rows = kv_to_numpy(buffer)  # a view: writing it writes the buffer
    for i, row in enumerate(run.tier_rows):
        rows[num_device + i] = row
    return StagedRun(run.start_block, run.dtype, rows[: run.num_blocks], run.hashes, run.lossy)


def unpin(engine: Engine, run: PinnedRun) -> None:
    """Give back the pins of `run` (tail first, as a request frees its blocks). Between steps."""
    engine.pool.free(run.device[::-1])


def stage_run(
    engine: Engine,
    token_ids: Sequence[int],
    cache_salt: str | None,
    start_block: int,
    end_block: int,
    buffer: torch.Tensor,
    hashes: Sequence[BlockHash] | None = None,
) -> StagedRun:
    """`pin_run`, `copy_run` into `buffer` and `unpin` at once: for a caller between steps.
    Does not mutate the cache (tier reads count as reads)."""
    run = pin_run(engine, token_ids, cache_salt, start_block, end_block, buffer.shape[0], hashes)
    try:
        return copy_run(engine.runner.kv_caches, run, buffer)
    finally:
        unpin(engine, run)


def _device_run(
    engine: Engine, hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int, end: int
) -> list[BlockId]:
    """The device blocks of `hashes[start:end]`, up to the first the pool does not hold."""
    bs = engine.config.block_size
    out: list[BlockId] = []
    for i in range(start, end):
        block_id = engine.pool.lookup(hashes[i], token_ids[i * bs : (i + 1) * bs])
        if block_id is None:
            break
        out.append(block_id)
    return out


def seal(staged: StagedRun, key: bytes, mode: str, fingerprint: str) -> KVChunk:
    """The chunk of a staged run with its digest: pure, off the engine's loop."""
    digest = chunk_digest(
        key,
        mode,
        fingerprint,
        staged.start_block,
        staged.hashes,
        staged.dtype,
        staged.payload,
        staged.lossy,
    )
    return KVChunk(staged.start_block, staged.dtype, staged.payload, digest, staged.lossy)
