"""The holder's side of a pull: the `ChunkExporter` its actor serves `export_chunk` with.

For each chunk a puller asks for, the exporter pins the run at a step boundary (`stage.pin_run`:
lookups and a reference per block, microseconds on the engine's loop), then on a transfer
thread gathers it into the chunk's staging room, seals it and ships it (`stage.copy_run`,
`stage.seal`), and gives the pins back at a later boundary. For a puller on this worker's Ray
node the room is a shared-memory slot the puller reads in place (the gather is the holder's only
copy); for one on another node, a reused host buffer whose payload is then copied into Ray's
object store (`workers.transfer.staging`). From then on the room belongs to the transfer:
nothing the engine does next can move or overwrite what is sent. The exporter is given the
prompt's token ids and the request's cache salt, not hashes: it computes the hashes itself under
that salt, so a request can only ever be served blocks of its own tenant. The puller's side is
`workers.engine.tiering.peer`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from cachesvc.kv.types import BlockHash
from workers.engine.tiering.peer import PULL_CHUNK_BLOCKS
from workers.peer.holds import HandoffHolds
from workers.peer.stage import PinnedRun, block_shape, copy_run, pin_run, prompt_hashes, seal, unpin
from workers.transfer.chunk import KVChunk
from workers.transfer.slots import PullerProcess, SlotLease
from workers.transfer.staging import Stager, Staging
from workers.transfer.threads import transfer_executor

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine


_HASHED_PROMPTS = 8  # prompts whose hashes an exporter keeps: the pulls it serves now
# How long a handed-off request's blocks stay pinned for its decode worker's pull (as long as a
# decode worker waits for one: `workers.cluster.DECODE_PULL_TIMEOUT_S`), and the share of the
# device pool such holds may take.
HOLD_TTL_S = 30.0
HOLD_POOL_SHARE = 0.5
# How long a chunk asked for while its prompt is still being computed (`follow`) may wait for
# it here; the puller's deadline, which cancels the call, usually comes first.
FOLLOW_WAIT_S = 120.0


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
        self._kv_caches = engine.engine.runner.kv_caches
        self._unpinning: set[asyncio.Future[Any]] = set()
        # Hashing prompts and sealing chunks, below the engine's priority and apart from the
        # default executor the engine's steps run in.
        self._threads = transfer_executor(config.peer_max_exports, "kv-export")
        self._exporting = asyncio.Semaphore(config.peer_max_exports)
        self._prompts: OrderedDict[tuple[str | None, int, bytes], _Prompt] = OrderedDict()
        self._prompts_lock = threading.Lock()  # its threads key and fill it
        self.num_exported_chunks = 0
        self.num_exported_bytes = 0
        self.holds = HandoffHolds(HOLD_TTL_S, int(engine.engine.pool.num_blocks * HOLD_POOL_SHARE))
        engine.at_boundary(self.holds.at_boundary)

    async def hold(self, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Keep the full blocks of this prompt pinned once computed, for a pull that will follow
        (`holds.HandoffHolds`): its chunks then wait for no step boundary here."""
        prompt = await self._prompt(token_ids, cache_salt)
        self.holds.expect(prompt.ids, prompt.hashes, cache_salt)
        # The slots that pull will want are made meanwhile, not when it asks (a first pull
        # would go through the object store while they are made).
        self.stager.prepare(len(prompt.hashes))

    async def export(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        start_block: int,
        end_block: int,
        puller: PullerProcess | None = None,
        follow: bool = False,
    ) -> KVChunk:
        """The chunk of blocks `start_block .. end_block - 1` this worker holds (its leading
        run, maybe empty), through a slot leased to `puller` when it is on this node. Waits on
        the engine's loop for one staging copy, no more. `follow`: the prompt is being computed
        here for a hand-off: its blocks are held as they come, and the call waits until
        `start_block` is (or the prompt is no longer being computed)."""
        prompt = await self._prompt(token_ids, cache_salt)
        if follow:
            self.holds.expect(prompt.ids, prompt.hashes, cache_salt)
            await self.holds.wait_for(prompt.hashes, start_block, end_block, FOLLOW_WAIT_S)
        async with self._exporting:
            staging = self.stager.take(puller, end_block - start_block)
            shipping: asyncio.Future[KVChunk] | None = None
            try:
                room = staging.buffer.shape[0]
                run = self.holds.lease(prompt.hashes, start_block, end_block, room)
                held = run is not None
                if run is None:
                    run = await self._pin(prompt, cache_salt, start_block, end_block, staging)
                shipping = asyncio.get_running_loop().run_in_executor(
                    self._threads, self._copy_seal_ship, run, staging
                )
                # The pins go back once the copy is done, whatever becomes of this call.
                shipping.add_done_callback(lambda done: self._release(run, held, done))
                chunk = await asyncio.shield(shipping)
            except BaseException:
                self._give_up(staging, shipping)
                raise
            self.stager.finish(staging, delivered=True)
        self.num_exported_chunks += 1
        self.num_exported_bytes += run.num_blocks * self.stager.block_bytes
        return chunk

    async def _pin(
        self, prompt: _Prompt, cache_salt: str | None, start: int, end: int, staging: Staging
    ) -> PinnedRun:
        """Pin the run at the engine's next step boundary. Cancelled meanwhile, the pins taken
        anyway are given back."""
        pinning = asyncio.ensure_future(
            self.engine.call(
                lambda e: pin_run(
                    e, prompt.ids, cache_salt, start, end, staging.buffer.shape[0], prompt.hashes
                )
            )
        )
        try:
            return await asyncio.shield(pinning)
        except asyncio.CancelledError:
            pinning.add_done_callback(self._unpin_pinned)
            raise

    def _release(self, run: PinnedRun, held: bool, shipping: asyncio.Future[KVChunk]) -> None:
        if held:
            ok = not shipping.cancelled() and shipping.exception() is None
            if self.holds.give_back(run, delivered=ok):
                # Sent in full: the pins go back now when no step runs, else at its end.
                self.engine.try_call(self.holds.at_boundary)
        else:
            self._unpin(run)

    def _unpin_pinned(self, pinning: asyncio.Future[PinnedRun]) -> None:
        if not pinning.cancelled() and pinning.exception() is None:
            self._unpin(pinning.result())

    def release(self, leases: Sequence[SlotLease]) -> int:
        """End the leases of this worker's slots that a puller is done with (its message): each
        ends only when it names a current lease and the capability it was issued with. How many
        ended. Does not block: the slots' rows are zeroed on the ring's thread."""
        return self.stager.release(leases)

    def counters(self) -> dict[str, float]:
        """What this worker sent to pullers, for its load report (`cachesvc_worker_tiering`):
        chunks and bytes, how many went through same-node slots, and its slots' state."""
        return {
            "peer_exported_chunks": float(self.num_exported_chunks),
            "peer_exported_bytes": float(self.num_exported_bytes),
            **self.stager.counters(),
            **self.holds.counters(),
        }

    def close(self) -> None:
        """Close the slots' segments (a puller still reading one keeps it mapped)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
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
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._prompt_of, token_ids, cache_salt)

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

    def _copy_seal_ship(self, run: PinnedRun, staging: Staging) -> KVChunk:
        """On a transfer thread: the pinned run into its room, sealed, on its way."""
        staged = copy_run(self._kv_caches, run, staging.buffer)
        fingerprint = self.engine.engine.loaded.fingerprint
        return self.stager.ship(staging, seal(staged, self.key, self.digest, fingerprint))

    def _unpin(self, run: PinnedRun) -> None:
        """Give the run's pins back at the engine's next step boundary (now, when idle)."""
        if run.device:
            task = asyncio.ensure_future(self.engine.call(lambda e: unpin(e, run)))
            self._unpinning.add(task)  # kept until done: a task nobody holds may be collected
            task.add_done_callback(self._unpinning.discard)


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
