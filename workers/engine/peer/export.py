"""The holder's side of a pull: stage a run at a step boundary, seal and ship it off the loop.

`stage_run` is the only part that touches the engine: between two steps (`AsyncEngine.call`) it
finds the leading run of a prompt's blocks this worker holds and copies it, in one batched
gather, into the chunk's staging room `[num_blocks, layers, ...]` — a few milliseconds per
chunk, bounded by `peer_stage_mb`. For a puller on this worker's Ray node the room is a
shared-memory slot the puller reads in place (the gather is the holder's only copy); for one on
another node, a reused host buffer whose payload is then copied into Ray's object store
(`workers.transfer.staging`). From then on the room belongs to the transfer: nothing the engine
does next can move or overwrite what is sent. `seal` (the digest) runs on another thread. The
exporter is given the prompt's token ids and the request's cache salt, not hashes: it computes
the hashes itself under that salt, so a request can only ever be served blocks of its own
tenant. The puller's side is `workers.engine.peer.pull`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from cachesvc.codec import KVBlock
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.types import BlockHash, BlockId
from workers.engine.kv_copy import gather_blocks, kv_to_numpy
from workers.engine.peer.pull import PULL_CHUNK_BLOCKS
from workers.transfer.chunk import KVChunk, chunk_digest
from workers.transfer.slots import PullerProcess
from workers.transfer.staging import Stager, Staging

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
    cancelled one leaves the queue), each staged between two steps — into a same-node slot for
    a puller on this node, else into a reused buffer — then sealed and shipped on a thread
    (`workers.transfer.staging`). `node_id`: this worker's Ray node (None outside Ray: no
    slots). Create and use it on the actor's event loop."""

    def __init__(self, engine: AsyncEngine, key: bytes, digest: str, node_id: str | None) -> None:
        config = engine.engine.config
        self.engine = engine
        self.key = key
        self.digest = digest
        self.stager = _stager(engine.engine, node_id)
        self._exporting = asyncio.Semaphore(config.peer_max_exports)
        self._prompts: OrderedDict[tuple[str | None, int, bytes], _Prompt] = OrderedDict()
        self._prompts_lock = threading.Lock()  # its threads key and fill it
        self.num_exported_chunks = 0
        self.num_exported_bytes = 0

    async def export(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        start_block: int,
        end_block: int,
        puller: PullerProcess | None = None,
    ) -> KVChunk:
        """The chunk of blocks `start_block .. end_block - 1` this worker holds (its leading
        run, maybe empty), through a slot leased to `puller` when it is on this node. Waits on
        the engine's loop for one staging copy, no more."""
        prompt = await self._prompt(token_ids, cache_salt)
        async with self._exporting:
            staging = self.stager.take(puller, end_block - start_block)
            shipping: asyncio.Future[KVChunk] | None = None
            try:
                staged = await self.engine.call(
                    lambda e: stage_run(
                        e,
                        prompt.ids,
                        cache_salt,
                        start_block,
                        end_block,
                        staging.buffer,
                        prompt.hashes,
                    )
                )
                shipping = asyncio.ensure_future(
                    asyncio.to_thread(self._seal_and_ship, staged, staging)
                )
                chunk = await asyncio.shield(shipping)
            except BaseException:
                self._give_up(staging, shipping)
                raise
            self.stager.finish(staging, delivered=True)
        self.num_exported_chunks += 1
        self.num_exported_bytes += staged.payload.nbytes
        return chunk

    def counters(self) -> dict[str, float]:
        """What this worker sent to pullers, for its load report (`cachesvc_worker_tiering`):
        chunks and bytes, how many went through same-node slots, and its slots' state."""
        return {
            "peer_exported_chunks": float(self.num_exported_chunks),
            "peer_exported_bytes": float(self.num_exported_bytes),
            **self.stager.counters(),
        }

    def close(self) -> None:
        """Close the slots' segments (a puller still reading one keeps it mapped)."""
        self.stager.close()

    async def _prompt(self, token_ids: Sequence[int], cache_salt: str | None) -> _Prompt:
        """The prompt's ids and hashes under `cache_salt`, computed once per pull (every chunk
        of it asks) on a thread: hashing a long prompt is milliseconds. The puller sends the
        ids as one numpy array, keyed here at once; a list is keyed on the thread (converting
        32K ints alone is a millisecond)."""
        if isinstance(token_ids, np.ndarray):
            key = _prompt_key(token_ids, cache_salt)
            with self._prompts_lock:
                prompt = self._prompts.get(key)
            if prompt is not None:
                return prompt
        return await asyncio.to_thread(self._prompt_of, token_ids, cache_salt)

    def _prompt_of(self, token_ids: Sequence[int], cache_salt: str | None) -> _Prompt:
        ids = np.asarray(token_ids, dtype=np.uint32)
        key = _prompt_key(ids, cache_salt)
        with self._prompts_lock:
            prompt = self._prompts.get(key)
        if prompt is None:
            as_list = ids.tolist()
            prompt = _Prompt(as_list, prompt_hashes(self.engine.engine, as_list, cache_salt))
            with self._prompts_lock:
                self._prompts[key] = prompt
                while len(self._prompts) > _HASHED_PROMPTS:
                    self._prompts.popitem(last=False)
        return prompt

    def _give_up(self, staging: Staging, shipping: asyncio.Future[KVChunk] | None) -> None:
        """Nobody gets the chunk (the call was cancelled or failed): its room is free again once
        the shipping, if any, ends, and a slot leased for it is taken back."""
        if shipping is None:
            self.stager.finish(staging, delivered=False)
        else:
            shipping.add_done_callback(lambda _: self.stager.finish(staging, delivered=False))

    def _seal_and_ship(self, staged: StagedRun, staging: Staging) -> KVChunk:
        fingerprint = self.engine.engine.loaded.fingerprint
        return self.stager.ship(staging, seal(staged, self.key, self.digest, fingerprint))


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    hashes: list[BlockHash]


def _prompt_key(ids: np.ndarray, cache_salt: str | None) -> tuple[str | None, int, bytes]:
    ids = ids.astype(np.uint32, copy=False)
    return (cache_salt, len(ids), xxhash.xxh3_128_digest(ids.tobytes()))


def _stager(engine: Engine, node_id: str | None) -> Stager:
    """The holder's staging room: buffers of `peer_stage_mb`, and `peer_shm_mb` of same-node
    slots of one pull chunk each (a bigger chunk goes through the object store)."""
    config = engine.config
    caches = engine.runner.kv_caches
    shape = block_shape(engine)
    per_block = int(np.prod(shape)) * caches[0].element_size()
    return Stager(
        shape,
        caches[0].dtype,
        buffer_blocks=(config.peer_stage_mb << 20) // per_block,
        slot_blocks=PULL_CHUNK_BLOCKS,
        ring_bytes=config.peer_shm_mb << 20,
        node_id=node_id,
        pin=caches[0].is_cuda,
    )
