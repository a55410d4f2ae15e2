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
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from cachesvc.codec import KVBlock
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.types import BlockHash, BlockId
from workers.engine.kv_copy import gather_blocks, kv_to_numpy
from workers.transfer.chunk import KVChunk, chunk_digest

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine


_HASHED_PROMPTS = 8  # prompts whose hashes an exporter keeps: the pulls it serves now


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


@torch.inference_mode()
def stage_run(
    engine: Engine,
    token_ids: Sequence[int],
    cache_salt: str | None,
    start_block: int,
    end_block: int,
    buffer: torch.Tensor,
    hashes: Sequence[BlockHash] | None = None,
) -> StagedRun:
    """Copy blocks `start_block .. end_block - 1` of a prompt under `cache_salt` that this engine
    holds, up to the first it lacks and at most as many as `buffer` (`staging_buffer`) holds,
    into `buffer`: the device pool's run in one gather, then what its local tiers hold after
    it. The run's payload is a view of `buffer`. `hashes`: the prompt's under `cache_salt`,
    when the caller has them already. Run it between steps; does not mutate the cache (tier
    reads count as reads)."""
    if hashes is None:
        hashes = prompt_hashes(engine, token_ids, cache_salt)
    hashes = hashes[: max(0, end_block)]
    first = max(0, start_block)
    end = min(len(hashes), first + buffer.shape[0])
    device = _device_run(engine, hashes, token_ids, first, end)
    if device:
        gather_blocks(engine.runner.kv_caches, device, buffer[: len(device)])
    rows = kv_to_numpy(buffer)  # a view: writing it writes the buffer
    # Lossy KV (dequantized, or computed over it) travels marked: the puller lands it marked,
    # so it never reaches a lossless tier there either.
    lossy = engine.pool.any_lossy(device)
    num = len(device)
    for i in range(first + num, end):
        block = held_in_tier(engine, hashes, i)
        if block is None:
            break
        rows[num] = block.array
        lossy = lossy or block.lossy
        num += 1
    run = tuple(hashes[first : first + num])
    return StagedRun(first, engine.config.dtype, rows[:num], run, lossy)


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
    cancelled one leaves the queue), each staged between two steps into a reused buffer, then
    sealed and shipped on a thread. `ship` moves a sealed chunk's payload out of the buffer (the
    actor's puts it into Ray's object store: `workers.transfer.ray_link.put_payload`); once it
    returns, the buffer serves the next chunk. Create and use it on the actor's event loop."""

    def __init__(
        self,
        engine: AsyncEngine,
        key: bytes,
        digest: str,
        ship: Callable[[KVChunk], KVChunk],
    ) -> None:
        config = engine.engine.config
        self.engine = engine
        self.key = key
        self.digest = digest
        self.ship = ship
        self.max_bytes = config.peer_stage_mb << 20
        self._slots = asyncio.Semaphore(config.peer_max_exports)
        self._hashes: OrderedDict[tuple[str | None, int, bytes], list[BlockHash]] = OrderedDict()
        self._hashes_lock = threading.Lock()  # its threads key and fill it
        self._buffers: list[torch.Tensor] = []  # free staging buffers (page faults cost more
        # than the copy itself on a CPU: fresh host memory for every chunk halves the rate)
        self.num_exported_chunks = 0
        self.num_exported_bytes = 0

    async def export(
        self, token_ids: Sequence[int], cache_salt: str | None, start_block: int, end_block: int
    ) -> KVChunk:
        """The chunk of blocks `start_block .. end_block - 1` this worker holds (its leading
        run, maybe empty). Waits on the engine's loop for one staging copy, no more."""
        hashes = await self._prompt_hashes(token_ids, cache_salt)
        async with self._slots:
            buffer = self._buffers.pop() if self._buffers else self._new_buffer()
            staged = await self.engine.call(
                lambda e: stage_run(
                    e, token_ids, cache_salt, start_block, end_block, buffer, hashes
                )
            )
            fingerprint = self.engine.engine.loaded.fingerprint
            shipping = asyncio.ensure_future(
                asyncio.to_thread(self._seal_and_ship, staged, fingerprint)
            )
            # The buffer is free again once the payload left it, even if this call is cancelled.
            shipping.add_done_callback(lambda _: self._buffers.append(buffer))
            chunk = await asyncio.shield(shipping)
        self.num_exported_chunks += 1
        self.num_exported_bytes += staged.payload.nbytes
        return chunk

    def counters(self) -> dict[str, float]:
        """What this worker sent to pullers, for its load report (`cachesvc_worker_tiering`)."""
        return {
            "peer_exported_chunks": float(self.num_exported_chunks),
            "peer_exported_bytes": float(self.num_exported_bytes),
        }

    async def _prompt_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None
    ) -> list[BlockHash]:
        """The prompt's hashes under `cache_salt`, computed once per pull (every chunk of it
        asks), off the loop: keying a long prompt alone is a millisecond, hashing it more."""
        return await asyncio.to_thread(self._hashes_of, token_ids, cache_salt)

    def _hashes_of(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        ids = np.asarray(token_ids, dtype=np.uint32)
        key = (cache_salt, len(ids), xxhash.xxh3_128_digest(ids.tobytes()))
        with self._hashes_lock:
            hashes = self._hashes.get(key)
        if hashes is None:
            hashes = prompt_hashes(self.engine.engine, token_ids, cache_salt)
            with self._hashes_lock:
                self._hashes[key] = hashes
                while len(self._hashes) > _HASHED_PROMPTS:
                    self._hashes.popitem(last=False)
        return hashes

    def _new_buffer(self) -> torch.Tensor:
        return staging_buffer(self.engine.engine, self.max_bytes)

    def _seal_and_ship(self, staged: StagedRun, fingerprint: str) -> KVChunk:
        return self.ship(seal(staged, self.key, self.digest, fingerprint))
