"""The workers as the router sees them: handles, load, health, and their KV event streams.

The supervisor (`router/supervisor.py`) pings and polls every worker (`WorkerActor.poll`) for
its load. The KV events come from an `EventSource` (`router/events_source.py`): with the polls
themselves, or from the workers' Redis Streams when Redis is configured. Either way the pool
applies them to the prefix index in order, per worker, and a gap or a new incarnation (a
restarted actor) resyncs the worker from a snapshot.

Health: a worker whose call fails with any Ray error, or that stops answering pings, is
UNHEALTHY (routed to only when no worker is healthy; its streams fail over); one that Ray says
is dead for good is DEAD: it leaves routing and the index, and the supervisor may replace it.
Ray is imported only inside the methods that call it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.events import Event
from cachesvc.index import IndexSnapshot, PrefixIndex
from cachesvc.types import WorkerId
from router.config import RouterConfig
from router.domain import Exhausted, InvalidInput, Unimplemented
from router.events_source import EventSource, StreamPosition, make_event_source
from router.ray_failures import Failure, actor_state, classify, ray_error_types
from workers.protocol import (
    HolderHint,
    PollResult,
    StreamDelta,
    StreamError,
    WorkerInfo,
    WorkerLoad,
)

_log = logging.getLogger(__name__)

# How long `sync` waits for a worker's stream to bring the events its poll announced. A stream
# that misses it is marked lagging and not waited for again until it moves: a Redis outage must
# not add this to every request.
_READ_YOUR_WRITES_S = 0.5


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failing; routed to only when no healthy worker is left
    DEAD = "dead"  # gone for good: out of routing and the index until replaced


class WorkerDied(Exception):
    """The worker failed during a call (died, restarting, unreachable or frozen)."""

    def __init__(self, worker: WorkerId, started: bool) -> None:
        super().__init__(f"worker {worker} died")
        self.worker = worker
        self.started = started  # True once the worker sent back part of the answer


@dataclass(frozen=True)
class ModelInfo:
    """What every worker must agree on: hashing and validation depend on it."""

    model_fingerprint: str
    block_size: int
    vocab_size: int
    max_model_len: int


@dataclass
class WorkerState:
    """One worker's handle and what the router knows about it; mutated by the pool only."""

    worker_id: WorkerId
    actor: Any
    info: WorkerInfo | None = None
    health: Health = Health.HEALTHY
    load: WorkerLoad = field(default_factory=WorkerLoad)
    missed_polls: int = 0
    failing_since: float | None = None  # monotonic time it became unhealthy
    num_replacements: int = 0
    # Requests this router has sent and not yet seen finish, and their prompt tokens not yet
    # prefilled: fresher than the polled load.
    num_inflight: int = 0
    num_inflight_tokens: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    incarnation: str = ""  # the life of the worker the index follows
    # Events through the event source (not the polls); the index holds those before
    # `stream_seq`; `advanced` is set, and replaced, whenever `stream_seq` moves.
    streamed: bool = False
    stream_seq: int = 0
    stream_lagging: bool = False
    advanced: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_requests(self) -> int:
        return max(self.load.num_running + self.load.num_waiting, self.num_inflight)

    @property
    def num_queued_tokens(self) -> int:
        return max(self.load.num_queued_tokens, self.num_inflight_tokens)


_ERRORS = {"invalid_argument": InvalidInput, "resource_exhausted": Exhausted}


def raise_stream_error(error: StreamError) -> None:
    """Turn a worker's refusal into the router's typed error."""
    raise _ERRORS.get(error.code, Unimplemented)(error.message)


class WorkerPool:
    """Owns the worker handles and keeps `index` in step with their events."""

    def __init__(
        self,
        actors: Mapping[WorkerId, Any],
        index: PrefixIndex,
        config: RouterConfig,
        events: EventSource | None = None,
    ) -> None:
        if not actors:
            raise ValueError("a worker pool needs at least one worker")
        self.index = index
        self.config = config
        self.events = events if events is not None else make_event_source(config)
        self.num_resyncs = 0
        self._workers = {w: WorkerState(w, a) for w, a in sorted(actors.items())}
        self._model: ModelInfo | None = None

    @property
    def model(self) -> ModelInfo:
        assert self._model is not None, "call start() first"
        return self._model

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> ModelInfo:
        """Wait for every worker to load its model, check that they agree, index what they
        hold and start following their events (the supervisor polls them from then on).
        Raises RuntimeError when the workers disagree."""
        states = list(self._workers.values())
        infos = await asyncio.wait_for(
            asyncio.gather(*(s.actor.info.remote() for s in states)), timeout_s
        )
        for state, info in zip(states, infos, strict=True):
            state.info, state.incarnation = info, info.incarnation
            state.streamed = self.events.follows(state.worker_id, info.event_stream)
        self._model = _agree(infos)
        await asyncio.gather(*(self._catch_up(s) for s in states))
        positions = {
            s.worker_id: StreamPosition(s.incarnation, s.stream_seq)
            for s in states
            if s.streamed and s.health is not Health.DEAD
        }
        await self.events.start(positions, self._apply_streamed)
        await asyncio.gather(*(self.poll(s) for s in states))  # every load known at start
        return self._model

    async def close(self) -> None:
        """Stop following the event streams; the actors are left running."""
        await self.events.close()

    async def adopt(self, worker: WorkerId, actor: Any, timeout_s: float) -> None:
        """Take `actor` as the new actor of a DEAD `worker` (a replacement): wait for its
        model, check it agrees with the others, index what it holds, follow its events, and
        make it HEALTHY. Raises on a failed start (the worker stays DEAD)."""
        state = self._workers[worker]
        assert state.health is Health.DEAD, "only a dead worker is replaced"
        info: WorkerInfo = await asyncio.wait_for(actor.info.remote(), timeout_s)
        if _agree([info]) != self.model:
            raise RuntimeError(f"the replacement of {worker} serves another model: {info}")
        async with state.lock:
            state.actor, state.info, state.incarnation = actor, info, info.incarnation
            state.streamed = self.events.follows(worker, info.event_stream)
            state.load, state.missed_polls = WorkerLoad(), 0
            await self._resync(state)
        if state.streamed:
            position = StreamPosition(state.incarnation, state.stream_seq)
            await self.events.follow(worker, position, self._apply_streamed)
        state.num_replacements += 1
        self._healthy(state)

    # ---- views ------------------------------------------------------------------------------

    def states(self) -> list[WorkerState]:
        return list(self._workers.values())

    def state(self, worker: WorkerId) -> WorkerState:
        return self._workers[worker]

    def routable(self) -> list[WorkerState]:
        """Healthy workers, or the unhealthy ones when none is healthy; never dead ones."""
        healthy = self.healthy()
        if healthy:
            return healthy
        return [s for s in self._workers.values() if s.health is Health.UNHEALTHY]

    def healthy(self) -> list[WorkerState]:
        return [s for s in self._workers.values() if s.health is Health.HEALTHY]

    # ---- calls ------------------------------------------------------------------------------

    async def stream(
        self,
        worker: WorkerId,
        prompt_ids: list[int],
        params: dict[str, Any],
        request_id: str,
        cache_salt: str | None,
        holder: HolderHint | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Forward a request and stream its deltas; raises WorkerDied (the worker failed, or
        stopped answering pings while the stream waited), or the router's typed error for a
        refusal. Closing the iterator early cancels the request on the worker. `holder` names
        a worker with a longer prefix of the prompt to pull from."""
        import ray

        state = self._workers[worker]
        actor = state.actor
        # The hint goes only when there is one, so a worker of an older build still answers.
        extra = () if holder is None else (holder,)
        gen = actor.generate.options(num_returns="streaming").remote(
            prompt_ids, params, request_id, cache_salt, *extra
        )
        started = done = False
        try:
            while (ref := await self._next_ref(state, gen, started)) is not None:
                item = await ref
                if isinstance(item, StreamError):
                    done = True
                    raise_stream_error(item)
                started = True
                yield item
            done = True
        except ray_error_types() as exc:
            done = True
            await self.failed(worker, exc)
            raise WorkerDied(worker, started) from exc
        finally:
            if not done:
                ray.cancel(gen)
                actor.abort.remote(request_id)

    async def _next_ref(self, state: WorkerState, gen: Any, started: bool) -> Any:
        """The stream's next object ref, None at its end. A slow step is waited for as long
        as the worker answers pings; once the supervisor finds it unhealthy (frozen, or its
        process gone) the stream fails over instead of waiting for it."""
        pending = asyncio.ensure_future(gen.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.config.stall_check_s)
                if done:
                    break
                if state.health is not Health.HEALTHY:
                    raise WorkerDied(state.worker_id, started)
        except BaseException:
            pending.cancel()
            raise
        try:
            return pending.result()
        except StopAsyncIteration:
            return None

    async def call(self, worker: WorkerId, method: str, *args: Any) -> Any:
        """Call a unary actor method; raises WorkerDied when the worker failed."""
        state = self._workers[worker]
        try:
            return await getattr(state.actor, method).remote(*args)
        except ray_error_types() as exc:
            await self.failed(worker, exc)
            raise WorkerDied(worker, started=False) from exc

    async def failed(self, worker: WorkerId, exc: BaseException) -> None:
        """A call to `worker` raised `exc` (a Ray error or a timeout): DEAD when Ray says its
        actor is dead for good, else UNHEALTHY until a poll answers again."""
        state = self._workers[worker]
        failure = classify(exc)
        if failure is Failure.TASK:
            _log.warning("worker %s failed a call: %s", worker, str(exc).splitlines()[:1])
            return
        if failure is Failure.GONE and await asyncio.to_thread(actor_state, state.actor) == "DEAD":
            self.mark_dead(worker, exc)
            return
        self.mark_unhealthy(state, f"{failure.value}: {type(exc).__name__}")

    def mark_unhealthy(self, state: WorkerState, reason: str) -> None:
        """Out of routing while a healthy worker is left; logged once per episode."""
        if state.health is Health.HEALTHY:
            _log.warning("worker %s is unhealthy (%s)", state.worker_id, reason)
            state.health, state.failing_since = Health.UNHEALTHY, time.monotonic()

    def mark_dead(self, worker: WorkerId, reason: object = "") -> None:
        """Take a worker out of routing and the index until it is replaced."""
        state = self._workers[worker]
        if state.health is not Health.DEAD:
            _log.warning("worker %s is dead: %s", worker, str(reason).splitlines()[0:1])
        state.health = Health.DEAD
        state.failing_since = state.failing_since or time.monotonic()
        self.events.forget(worker)
        self.index.drop_worker(worker)

    def _healthy(self, state: WorkerState) -> None:
        if state.health is not Health.HEALTHY:
            _log.warning("worker %s is healthy again", state.worker_id)
        state.health, state.failing_since, state.missed_polls = Health.HEALTHY, None, 0

    # ---- events -----------------------------------------------------------------------------

    async def sync(self, worker: WorkerId) -> None:
        """Poll one worker now: its load, and its events into the index. When its events come
        through a stream, also wait (briefly) until the index holds every event the worker had
        made by the poll: a caller that has its answer then sees its blocks."""
        state = self._workers[worker]
        announced = await self.poll(state)
        if announced is not None and state.streamed:
            await self._await_stream(state, announced)

    async def poll(self, state: WorkerState) -> int | None:
        """Load, incarnation check and (unless streamed) events of one worker; returns the
        worker's next event sequence number, None when the poll failed (a missed poll)."""
        if state.health is Health.DEAD:
            return None
        async with state.lock:  # events of one worker are applied in order
            since = None if state.streamed else (self.index.next_seq(state.worker_id) or 0)
            try:
                result: PollResult = await asyncio.wait_for(
                    state.actor.poll.remote(since), self.config.call_timeout_s
                )
            except ray_error_types() as exc:
                self.missed(state, exc)
                return None
            state.load = result.load
            self._healthy(state)
            # With no events (streamed), `apply` still checks the index follows this life.
            if not self.index.apply(state.worker_id, result.incarnation, result.events):
                await self._resync(state)
        return result.next_seq

    async def _apply_streamed(
        self, worker: WorkerId, incarnation: str, events: Sequence[Event]
    ) -> None:
        """Apply events the stream delivered (oldest first), resyncing on a gap."""
        state = self._workers.get(worker)
        if state is None or state.health is Health.DEAD or not events:
            return
        async with state.lock:
            if incarnation != state.incarnation:
                await self._resync(state)  # a restarted worker: learn its new life
                if incarnation != state.incarnation:
                    return  # entries of a past life, still in the stream
            if self.index.apply(worker, incarnation, events):
                self._advance(state, incarnation, events[-1].seq + 1)
            else:
                await self._resync(state)

    async def _await_stream(self, state: WorkerState, next_seq: int) -> None:
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

    async def _catch_up(self, state: WorkerState) -> None:
        """At start: a shared index that already follows this life of the worker (another
        router, or this one before a restart, kept it in Redis) only needs the newer events;
        otherwise take a snapshot."""
        if self.index.apply(state.worker_id, state.incarnation, ()):
            self._advance(state, state.incarnation, self.index.next_seq(state.worker_id) or 0)
            await self.poll(state)
        else:
            await self._resync(state)

    async def _resync(self, state: WorkerState) -> None:
        try:
            snapshot: IndexSnapshot = await asyncio.wait_for(
                state.actor.snapshot.remote(), self.config.call_timeout_s
            )
        except ray_error_types() as exc:
            self.missed(state, exc)
            return
        self.index.resync(state.worker_id, snapshot)
        self._advance(state, snapshot.incarnation, snapshot.next_seq)
        self.num_resyncs += 1

    def missed(self, state: WorkerState, exc: BaseException) -> None:
        """A poll or ping that failed; `max_missed_polls` in a row make the worker unhealthy
        (one that failed with the process gone counts at once)."""
        state.missed_polls += 1
        gone = classify(exc) is Failure.GONE
        if gone or state.missed_polls >= self.config.max_missed_polls:
            self.mark_unhealthy(state, f"{state.missed_polls} missed polls: {type(exc).__name__}")


def _agree(infos: list[WorkerInfo]) -> ModelInfo:
    models = {
        ModelInfo(i.model_fingerprint, i.block_size, i.vocab_size, i.max_model_len) for i in infos
    }
    if len(models) != 1:
        raise RuntimeError(
            "workers serve different models or block sizes; every worker must load the same "
            f"model with the same block size: {sorted(map(str, models))}"
        )
    return models.pop()
