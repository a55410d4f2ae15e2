"""Keeps the router's prefix index in step with the workers' KV events.

The events come with the polls, or from an `EventSource` (`router/pool/events_source.py`) when the
workers publish them to Redis Streams. Either way they are applied to the index in order, per
worker (under the worker's lock), and a gap or a new incarnation (a restarted actor) resyncs the
worker from a snapshot. What the applied events removed and stored also feeds the pool's record
of recently removed blocks (`router/pool/ghosts.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from cachesvc.kv.events import Event
from cachesvc.kv.index import IndexSnapshot, PrefixIndex
from cachesvc.kv.types import WorkerId
from router.pool.events_source import EventSource, StreamPosition
from router.pool.ghosts import GhostRecord
from router.pool.ray_failures import ray_error_types
from router.pool.worker_state import Health, WorkerState
from workers.protocol import PollResult

_log = logging.getLogger(__name__)

# How long `await_stream` waits for a worker's stream to bring the events its poll announced. A
# stream that misses it is marked lagging and not waited for again until it moves: a Redis outage
# must not add this to every request.
_READ_YOUR_WRITES_S = 0.5

# Told of a snapshot call that failed (the pool judges it: only a process gone counts).
Missed = Callable[[WorkerState, BaseException], None]


class IndexSync:
    """Applies each worker's events to `index`, resyncing it from a snapshot when needed.

    `workers` is the pool's own table (read, never changed here); only the event position of a
    worker's state (`incarnation`, `stream_seq`, `stream_lagging`, `advanced`) is written.
    """

    def __init__(
        self,
        index: PrefixIndex,
        events: EventSource,
        workers: Mapping[WorkerId, WorkerState],
        call_timeout_s: float,
        missed: Missed,
    ) -> None:
        self.index = index
        self.events = events
        self.num_resyncs = 0
        self.ghosts = GhostRecord()
        self._workers = workers
        self._call_timeout_s = call_timeout_s
        self._missed = missed

    async def start(self, states: Sequence[WorkerState]) -> None:
        """Follow the streams of the streamed, live workers, from where the index stands."""
        positions = {
            s.worker_id: StreamPosition(s.incarnation, s.stream_seq)
            for s in states
            if s.streamed and s.health is not Health.DEAD
        }
        await self.events.start(positions, self._apply_streamed)

    async def follow(self, state: WorkerState) -> None:
        """Follow the stream of a worker that was just (re)synced, if it has one."""
        if state.streamed:
            position = StreamPosition(state.incarnation, state.stream_seq)
            await self.events.follow(state.worker_id, position, self._apply_streamed)

    def forget(self, worker: WorkerId) -> None:
        """Stop following a dead worker and drop what the index says it holds."""
        self.events.forget(worker)
        self.index.drop_worker(worker)

    def polled_since(self, state: WorkerState) -> int | None:
        """The event sequence number a poll asks from; None when its events are streamed."""
        return None if state.streamed else (self.index.next_seq(state.worker_id) or 0)

    async def apply_polled(self, state: WorkerState, result: PollResult) -> None:
        """Apply a poll's events, resyncing on a gap or a new life; call under `state.lock`."""
        # With no events (streamed), `apply` still checks the index follows this life.
        if self.index.apply(state.worker_id, result.incarnation, result.events):
            self.ghosts.observe(result.events)
        else:
            await self.resync(state)

    async def _apply_streamed(
        self, worker: WorkerId, incarnation: str, events: Sequence[Event]
    ) -> None:
        """Apply events the stream delivered (oldest first), resyncing on a gap."""
        state = self._workers.get(worker)
        if state is None or state.health is Health.DEAD or not events:
            return
        async with state.lock:
            if incarnation != state.incarnation:
                await self.resync(state)  # a restarted worker: learn its new life
                if incarnation != state.incarnation:
                    return  # entries of a past life, still in the stream
            if self.index.apply(worker, incarnation, events):
                self.ghosts.observe(events)
                self._advance(state, incarnation, events[-1].seq + 1)
            else:
                await self.resync(state)

    async def await_stream(self, state: WorkerState, next_seq: int) -> None:
        """Wait (briefly) until the stream brought the worker's events before `next_seq`; a
        stream that does not in time is marked lagging and not waited for until it moves."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _READ_YOUR_WRITES_S
        while state.stream_seq < next_seq and not state.stream_lagging:
            advanced = state.advanced
            try:
                await asyncio.wait_for(advanced.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                _log.info("worker %s: its event stream lags; not waiting for it", state.worker_id)
                state.stream_lagging = True

    def _advance(self, state: WorkerState, incarnation: str, next_seq: int) -> None:
        if incarnation != state.incarnation:  # a new life numbers its events from zero
            state.incarnation, state.stream_seq = incarnation, next_seq
        elif next_seq <= state.stream_seq:
            return
        state.stream_seq, state.stream_lagging = next_seq, False
        state.advanced.set()
        state.advanced = asyncio.Event()

    async def catch_up(self, state: WorkerState) -> bool:
        """At start: True when a shared index already follows this life of the worker (another
        router, or this one before a restart, kept it in Redis) and only needs the newer events
        (poll it); otherwise the worker is resynced from a snapshot, and False."""
        if self.index.apply(state.worker_id, state.incarnation, ()):
            self._advance(state, state.incarnation, self.index.next_seq(state.worker_id) or 0)
            return True
        await self.resync(state)
        return False

    async def resync(self, state: WorkerState) -> None:
        """Replace what the index says the worker holds with its snapshot; a snapshot call that
        fails is told to the pool, and leaves the index as it was."""
        try:
            snapshot: IndexSnapshot = await asyncio.wait_for(
                state.actor.snapshot.remote(), self._call_timeout_s
            )
        except ray_error_types() as exc:
            self._missed(state, exc)
            return
        self.index.resync(state.worker_id, snapshot)
        self._advance(state, snapshot.incarnation, snapshot.next_seq)
        self.num_resyncs += 1
