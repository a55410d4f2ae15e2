"""The Ray actor of one worker: a thin async wrapper around AsyncEngine.

What crosses the process boundary is defined in `workers/protocol.py` (plain dataclasses): the
router imports that, never this module. The engine is imported inside the actor, and ray only
inside `workers.spawn.spawn_worker`.

Liveness: `ping` runs in a Ray concurrency group of its own (its own thread and event loop), so
it is answered however long a step runs, and says how long the running step has run and how long
the actor's event loop has not turned (a tick on the loop every `_TICK_S`): the router tells a
long step from a hang by that, not by a timeout. `poll` never waits for a step either: it
answers with the load and events of the last step boundary.

KV events are numbered by the engine and collected at every step boundary
(`workers/event_buffer.py`); the operator's cache calls are `workers/cache_ops.py`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cachesvc.kv.block_pool import NoFreeBlocksError
from cachesvc.kv.events_redis import EventStreamConfig
from cachesvc.kv.index import IndexSnapshot
from workers.cache_ops import CacheOps
from workers.config import EngineConfig
from workers.deltas import ray_node, stream_delta
from workers.event_buffer import EventBuffer
from workers.mux import MuxTable
from workers.protocol import (
    CacheHints,
    Heartbeat,
    HolderHint,
    MuxBatch,
    PollResult,
    StreamDelta,
    StreamError,
    WorkerInfo,
    WorkerLoad,
)
from workers.reports import index_snapshot, worker_load

if TYPE_CHECKING:
    from collections.abc import Sequence

    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine
    from workers.peer.export import ChunkExporter
    from workers.transfer.chunk import KVChunk
    from workers.transfer.slots import PullerProcess, SlotLease

# ---- the actor ---------------------------------------------------------------------------------


def _exporter(engine: AsyncEngine, config: EngineConfig) -> ChunkExporter:
    from workers.peer.export import ChunkExporter
    from workers.transfer.chunk import chunk_key

    key = engine.engine.cache_admin.tier_key  # read once, with the engine's tiers
    # Its Ray node: a puller on the same node reads its chunks from shared-memory slots.
    return ChunkExporter(engine, chunk_key(key), config.peer_digest, ray_node()["node_id"])


_TICK_S = 0.1  # how often the event loop notes that it turns, for `ping`
LIVENESS_GROUP = "liveness"  # the Ray concurrency group `ping` runs in
_log = logging.getLogger(__name__)


class WorkerActor(CacheOps):
    """One model replica. Create it through `spawn_worker`; every method is async."""

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        max_queued_requests: int,
        event_stream: EventStreamConfig | None = None,
        actor_name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        from workers.engine.async_engine import AsyncEngine
        from workers.engine.engine import Engine
        from workers.peer.prefetch import Prefetcher

        engine = Engine(config)
        if config.peer_pull:
            import ray

            from workers.transfer.ray_link import RayPeerLink

            # Peers are named in this actor's namespace, which is not its job's when the actor
            # was given one (`spawn_worker`): the runtime context only knows the job's.
            engine.attach_peers(RayPeerLink(namespace or ray.get_runtime_context().namespace))
        self._engine: AsyncEngine = AsyncEngine(engine)
        # Serves peers' pulls of this worker's KV (`export_chunk`), whether or not it pulls.
        self._exporter: ChunkExporter = _exporter(self._engine, config)
        self._prefetcher = Prefetcher(self._engine)  # a hand-off's pull while its prefill runs
        publisher = None
        if event_stream is not None:
            from cachesvc.kv.events_redis import StreamPublisher

            publisher = StreamPublisher.from_config(event_stream, worker_id)
        self._events = EventBuffer(uuid.uuid4().hex, publisher)
        # What a step changed reaches `poll` at its end: a poll never waits for a step.
        self._engine.at_boundary(self._events.collect)
        self._max_queued = max_queued_requests
        self._publishing: asyncio.Task[None] | None = None
        self._open: set[str] = set()  # request ids of open `generate` streams
        self._muxes = MuxTable()  # by the routers' ids (`open_mux`)
        self._closed = False
        self._ticking: asyncio.Task[None] | None = None
        self._last_tick: float | None = None  # monotonic; read by `ping` from its own thread
        self._info = WorkerInfo(
            worker_id=worker_id,
            incarnation=self._events.incarnation,
            model_fingerprint=engine.loaded.fingerprint,
            block_size=config.block_size,
            vocab_size=engine.loaded.config.vocab_size,
            max_model_len=engine.max_model_len,
            device=config.device,
            event_stream=None if publisher is None else publisher.key,
            actor_name=actor_name,
            **ray_node(),
            role=config.role,
            step_tokens=config.max_num_batched_tokens,
        )

    async def info(self) -> WorkerInfo:
        self._ensure_tasks()
        return self._info

    async def ping(self) -> Heartbeat:
        """Answered in the `LIVENESS_GROUP` concurrency group, on a thread of its own: never
        waits for a step nor for the actor's event loop, and touches nothing but two numbers
        (a frozen process, SIGSTOP or a dead node, does not answer at all)."""
        last = self._last_tick
        stall = 0.0 if last is None else max(0.0, time.monotonic() - last - _TICK_S)
        return Heartbeat(self._info.incarnation, self._engine.busy_s, stall)

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        request_id: str,
        cache_salt: str | None,
        holder: HolderHint | None = None,
        hold_kv: bool = False,
        cache: CacheHints | None = None,
    ) -> AsyncIterator[StreamDelta | StreamError]:
        """Stream deltas of every sample (call with num_returns="streaming").

        Refusals are yielded as one StreamError, never raised, so the router can tell a bad
        request from a dead worker; so is a failure of the engine while serving this request
        alone ("internal": the router does not retry it elsewhere, where it would fail alike).
        With `holder` (and `peer_pull` configured), the load planner may pull the blocks of the
        prompt it holds beyond what this worker holds.
        `hold_kv`: another worker will pull this prompt's blocks (a prefill handed off): they
        stay pinned from the step that computes them, so the pull waits for no step here.
        `cache`: the request's explicit cache controls (retention, session, skip flags).
        """
        from workers.engine.outputs import RequestFailed
        from workers.engine.prompt import PromptError
        from workers.sampling_params import SamplingParams

        self._ensure_tasks()
        load = self._engine.load
        if self._closed:
            yield StreamError("resource_exhausted", "the worker is shutting down")
            return
        if load.num_running + load.num_waiting >= self._max_queued:
            yield StreamError("resource_exhausted", f"worker queue is full ({self._max_queued})")
            return
        try:
            sampling = SamplingParams(**params)
        except (TypeError, ValueError) as exc:
            yield StreamError("invalid_argument", f"sampling: {exc}")
            return
        peer, prefetched = None, 0
        if holder is not None and self._engine.engine.config.peer_pull:
            from workers.engine.request import PeerSource

            peer = PeerSource(holder.actor_name, holder.num_blocks, holder.handoff)
            # A prefetch of this prompt still under way brings its blocks: wait, not pull twice.
            timeout_s = self._engine.engine.config.peer_pull_timeout_s
            prefetched = await self._prefetcher.settled(
                prompt_ids, cache_salt, holder.num_blocks, timeout_s
            )
        if hold_kv:
            await self._exporter.hold(prompt_ids, cache_salt)
        sent: dict[int, int] = {}
        self._open.add(request_id)
        pulled = False  # a sample ended for its max_tokens: the hand-off's pull follows
        try:
            args = (prompt_ids, sampling, request_id, cache_salt, peer)
            async for out in self._engine.generate(
                *args, coalesce=True, cache=cache
            ):  # a Ray item: ~0.3 ms
                worker = self._info.worker_id
                delta = stream_delta(out, request_id, sampling.n, sent, worker, prefetched)
                pulled = pulled or delta.finish_reason == "length"
                yield delta
        except PromptError as exc:
            yield StreamError("invalid_argument", f"prompt: {exc}")
        except RequestFailed as exc:
            where = self._info.worker_id
            yield StreamError("internal", f"the request failed on worker {where}: {exc.message}")
        finally:
            self._open.discard(request_id)
            if hold_kv and not pulled:  # aborted, failed or stopped: no pull will come
                self._release_hold(prompt_ids, cache_salt)

    async def open_mux(self, mux_id: str) -> AsyncIterator[MuxBatch]:
        """The deltas of every stream `submit`ted under `mux_id`, a batch per step (call with
        num_returns="streaming"; `workers/mux.py`). Ends when the worker closes; cancelling it
        aborts its streams."""
        self._ensure_tasks()
        mux = self._muxes.get(mux_id)
        try:
            if mux is not None:
                async for batch in mux.batches():
                    yield batch
        finally:
            self._muxes.end(mux_id)

    async def submit(self, mux_id: str, key: int, *args: Any, **kwargs: Any) -> bool:
        """`generate(*args, **kwargs)`, its items sent under `key` through the mux `mux_id`
        (opened before or after this call) and followed by the stream's end; False when that
        mux has ended."""
        mux = self._muxes.get(mux_id)
        if mux is None:
            return False
        mux.run(key, self.generate(*args, **kwargs))
        return True

    async def release_hold(self, prompt_ids: list[int], cache_salt: str | None) -> None:
        """Unpin the prompt kept for a hand-off's pull (`hold_kv`): the pull is over, or the
        hand-off will not happen (the router's word). Nothing when none is kept."""
        self._release_hold(prompt_ids, cache_salt)

    def _release_hold(self, prompt_ids: Sequence[int], cache_salt: str | None) -> None:
        holds = self._exporter.holds
        if holds.release(prompt_ids, cache_salt):  # its pins go now, or at the step's end
            self._engine.try_call(holds.at_boundary)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def cancel_stream(self, mux_id: str, key: int, request_id: str) -> None:
        """Stop the stream `key` of the mux `mux_id` (`submit`), even one whose `submit` has
        not arrived yet, and abort its request."""
        mux = self._muxes.find(mux_id)
        if mux is not None:
            mux.cancel(key)
        await self._engine.abort(request_id)

    async def export_chunk(
        self,
        prompt_ids: Sequence[int],
        cache_salt: str | None,
        start_block: int,
        end_block: int,
        puller: PullerProcess | None = None,
        follow: bool = False,
    ) -> KVChunk:
        """The blocks `start_block .. end_block - 1` of a prompt under `cache_salt` that this
        worker holds, up to the first it lacks, as one buffer (`workers.transfer`): staged
        between steps, sealed off the loop; in a shared-memory slot leased to `puller` when it
        runs on this worker's node, else through the object store. `follow`: the prompt is
        being computed here for a hand-off, and the call waits for its blocks."""
        return await self._exporter.export(
            prompt_ids, cache_salt, start_block, end_block, puller, follow
        )

    async def release_slots(self, leases: Sequence[SlotLease]) -> int:
        """End the leases of this worker's same-node slots that a puller is done with: its
        message once it no longer reads them (`workers.transfer.slots`). A lease ends only when
        named with the capability this worker issued on its pull; how many ended."""
        return self._exporter.release(leases)

    async def prefetch(
        self,
        holder: HolderHint,
        prompt_ids: Sequence[int],
        cache_salt: str | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        """Pull the prompt's blocks from `holder` while it computes them, into this worker's
        pool (`workers.peer.prefetch`), for a handed-off request that will follow; what
        it did, as a dict (`PrefetchResult`)."""
        result = await self._prefetcher.prefetch(
            holder.actor_name, prompt_ids, cache_salt, holder.num_blocks, timeout_s
        )
        return dataclasses.asdict(result)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` with the worker's own tokenizer (as `generate` would see it)."""
        return await self._engine.call(lambda e: e.encode_prompt(text))

    async def score(
        self, prefix_ids: list[int], items_ids: list[list[int]], label_token_ids: list[int]
    ) -> list[list[float]] | StreamError:
        """Log-probs of each label token after prefix + item, per item.

        `Engine.score` is assumed to run its own forward passes without stepping the shared
        scheduler; it runs exclusively, between steps. Too few free KV blocks right now is
        `resource_exhausted` (retry later); a pass that can never fit is `invalid_argument`."""
        try:
            return await self._engine.run_exclusive(
                lambda e: e.score(prefix_ids, items_ids, label_token_ids)
            )
        except NoFreeBlocksError as exc:
            return StreamError("resource_exhausted", str(exc))
        except ValueError as exc:
            return StreamError("invalid_argument", str(exc))

    async def poll(self, since_seq: int | None) -> PollResult:
        """Load and KV events numbered `since_seq` and later (a gap tells the caller to
        resync from `snapshot`); None asks for no events (the caller follows the stream).
        Never waits for a step: while one runs, the answer is as of the last step boundary."""
        self._ensure_tasks()
        self._engine.try_call(self._events.collect)
        events = () if since_seq is None else self._events.since(since_seq)
        return PollResult(self._info.incarnation, self._load(), events, self._events.next_seq)

    async def snapshot(self) -> IndexSnapshot:
        """Every block hash held, per tier, consistent with the event numbering."""
        return await self._engine.call(self._snapshot)

    async def stats(self) -> WorkerLoad:
        return self._load()

    async def close(self, timeout_s: float = 30.0) -> bool:
        """Stop serving: abort open requests, stop the engine loop, close the tiers
        (`Engine.close`: the device cache goes to NVMe when there is one, queued writes are
        flushed), then flush the event stream. Idempotent; the
        actor is left alive (the owner kills it). False when the event stream could not be
        flushed within `timeout_s`."""
        if self._closed:
            return True
        self._closed = True
        for request_id in list(self._open):
            await self._engine.abort(request_id)
        if self._publishing is not None:
            self._publishing.cancel()
        # Between steps, in a thread (an NVMe flush blocks): no step runs while tiers close.
        await self._engine.run_exclusive(self._close_engine)
        await self._engine.shutdown()
        self._muxes.end_all()  # their routers see the end of the stream
        publisher = self._events.publisher
        if publisher is None:
            return True
        return await asyncio.to_thread(publisher.close, timeout_s)

    # ---- helpers ----------------------------------------------------------------------------

    def _close_engine(self, engine: Engine) -> None:
        engine.close()
        self._events.collect(engine)  # what closing the tiers changed, for the last readers

    def _ensure_tasks(self) -> None:
        """Start the loop's tick and the task that collects events for the stream (on the
        actor's loop, which only exists once a method runs)."""
        loop = asyncio.get_running_loop()
        if self._ticking is None or self._ticking.done():
            self._ticking = loop.create_task(self._tick_forever())
        if self._events.publisher is None or self._closed:
            return
        if self._publishing is None or self._publishing.done():
            self._publishing = loop.create_task(self._events.publish_forever(self._engine))

    async def _tick_forever(self) -> None:
        while True:
            self._last_tick = time.monotonic()
            await asyncio.sleep(_TICK_S)

    def _snapshot(self, engine: Engine) -> IndexSnapshot:
        self._events.collect(engine)
        return index_snapshot(engine, self._info.incarnation)

    def _load(self) -> WorkerLoad:
        counters = {**self._exporter.counters(), **self._prefetcher.counters()}
        return worker_load(self._engine.load, self._engine.engine.tiering, counters)
