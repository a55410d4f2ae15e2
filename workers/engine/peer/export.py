"""The holder's side of a pull: stage a run at a step boundary, seal it off the loop.

`stage_run` is the only part that touches the engine: between two steps (`AsyncEngine.call`) it
finds the leading run of a prompt's blocks this worker holds and copies it, in one batched
gather, into a fresh host buffer `[num_blocks, layers, ...]` — a few milliseconds per chunk,
bounded by `peer_stage_mb`. From then on the buffer belongs to the transfer: nothing the engine
does next can move or overwrite what is sent. `seal` (the digest) runs on another thread, and
the buffer leaves the process as a numpy array through Ray's object store (out of band, no
pickle). The exporter is given the prompt's token ids and the request's cache salt, not hashes:
it computes the hashes itself under that salt, so a request can only ever be served blocks of
its own tenant. The puller's side is `workers.engine.peer.pull`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cachesvc.codec import KVBlock
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.types import BlockHash, BlockId
from workers.engine.kv_copy import gather_blocks, kv_to_numpy
from workers.transfer.chunk import KVChunk, chunk_digest

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine


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


@torch.inference_mode()
def stage_run(
    engine: Engine,
    token_ids: Sequence[int],
    cache_salt: str | None,
    start_block: int,
    end_block: int,
    max_bytes: int,
) -> StagedRun:
    """Copy blocks `start_block .. end_block - 1` of a prompt under `cache_salt` that this engine
    holds, up to the first it lacks and at most `max_bytes`: the device pool's run in one
    gather, then what its local tiers hold after it. Run it between steps; does not mutate the
    cache (tier reads count as reads)."""
    hashes = prompt_hashes(engine, token_ids, cache_salt)[: max(0, end_block)]
    caches = engine.runner.kv_caches
    storage = kv_to_numpy(caches[0][:1]).dtype
    shape = block_shape(engine)
    max_blocks = max(1, max_bytes // (int(np.prod(shape)) * storage.itemsize))
    end = min(len(hashes), max(0, start_block) + max_blocks)
    device = _device_run(engine, hashes, token_ids, max(0, start_block), end)
    parts = [kv_to_numpy(gather_blocks(caches, device))] if device else []
    # Lossy KV (dequantized, or computed over it) travels marked: the puller lands it marked,
    # so it never reaches a lossless tier there either.
    lossy = engine.pool.any_lossy(device)
    tier_arrays: list[np.ndarray] = []
    for i in range(max(0, start_block) + len(device), end):
        block = held_in_tier(engine, hashes, i)
        if block is None:
            break
        tier_arrays.append(block.array)
        lossy = lossy or block.lossy
    if tier_arrays:
        parts.append(np.stack(tier_arrays))
    payload = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else None
    if payload is None:
        payload = np.empty((0, *shape), dtype=storage)
    first = max(0, start_block)
    run = tuple(hashes[first : first + payload.shape[0]])
    return StagedRun(first, engine.config.dtype, payload, run, lossy)


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


class ChunkExporter:
    """Serves a holder's chunks: at most `max_exports` at once (the rest wait their turn, and a
    cancelled one leaves the queue), each staged between two steps and sealed on a thread.
    Create and use it on the actor's event loop."""

    def __init__(self, engine: AsyncEngine, key: bytes, digest: str) -> None:
        config = engine.engine.config
        self.engine = engine
        self.key = key
        self.digest = digest
        self.max_bytes = config.peer_stage_mb << 20
        self._slots = asyncio.Semaphore(config.peer_max_exports)
        self.num_exported_chunks = 0
        self.num_exported_bytes = 0

    async def export(
        self, token_ids: Sequence[int], cache_salt: str | None, start_block: int, end_block: int
    ) -> KVChunk:
        """The chunk of blocks `start_block .. end_block - 1` this worker holds (its leading
        run, maybe empty). Never waits on a step for more than one staging copy."""
        async with self._slots:
            staged = await self.engine.call(
                lambda e: stage_run(
                    e, token_ids, cache_salt, start_block, end_block, self.max_bytes
                )
            )
            fingerprint = self.engine.engine.loaded.fingerprint
            chunk = await asyncio.to_thread(seal, staged, self.key, self.digest, fingerprint)
        self.num_exported_chunks += 1
        self.num_exported_bytes += chunk.payload.nbytes
        return chunk
