"""The workers as the router sees them: handles, load, health, and calls to them.

The supervisor (`router/pool/supervisor.py`) pings and polls every worker (`WorkerActor.poll`) for
its load. Their KV events, with the polls or from their Redis Streams, reach the prefix index
through the pool's `IndexSync` (`router/pool/index_sync.py`).

Health: a worker whose call fails with any Ray error, that stops answering pings, or whose
answered ping says its engine or event loop has made no progress for `hang_after_s`, is
UNHEALTHY (routed to only when no worker is healthy; its streams fail over); one that Ray says
is dead for good is DEAD: it leaves routing and the index, and the supervisor may replace it.
A poll or snapshot that times out is no verdict (the worker may be in a long step): only pings
count. Ray is imported only inside the methods that call it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachesvc.kv.index import PrefixIndex
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.pool.events_source import EventSource, make_event_source
from router.pool.ghosts import GhostRecord
from router.pool.index_sync import IndexSync
from router.pool.ray_failures import Failure, actor_state, classify, off_loop, ray_error_types
from router.pool.worker_errors import WorkerDied
from router.pool.worker_mux import WorkerMux
from router.pool.worker_state import Health, WorkerState
from router.pool.worker_streams import StreamCalls
from workers.protocol import (
    Heartbeat,
    PollResult,
    TenantQuota,
    WorkerInfo,
    WorkerLoad,
)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What every worker must agree on: hashing and validation depend on it."""

    model_fingerprint: str
    block_size: int
    vocab_size: int
    max_model_len: int


class WorkerPool(StreamCalls):
    """Owns the worker handles, their health and the calls to them; keeps `index` in step with
    their events through its `IndexSync`."""

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
        self._workers = {w: WorkerState(w, a) for w, a in sorted(actors.items())}
        self._sync = IndexSync(
            index, self.events, self._workers, config.call_timeout_s, self._poll_failed
        )
        self._model: ModelInfo | None = None
        # The tenants' quotas every worker is given when it joins (`set_quotas`); the router's
        # `QuotaTable` replaces it. Empty: none to give (a worker of an older build still joins).
        self.quotas: dict[str, TenantQuota] = {}
        self._muxes: dict[WorkerId, WorkerMux] = {}  # each worker's (`multiplex_streams`)

    @property
    def ghosts(self) -> GhostRecord:
        """The blocks the workers recently removed (`router/pool/ghosts.py`)."""
        return self._sync.ghosts

    @property
    def num_resyncs(self) -> int:
        """Times a worker's part of the index was replaced by its snapshot."""
        return self._sync.num_resyncs

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
        await asyncio.gather(*(self._give_quotas(s.worker_id, s.actor) for s in states))
        await asyncio.gather(*(self._catch_up(s) for s in states))
        await self._sync.start(states)
        await asyncio.gather(*(self.poll(s) for s in states))  # every load known at start
        return self._model

    async def close(self) -> None:
        """Stop following the event streams and close the muxes; the actors are left running."""
        await self.events.close()
        for mux in self._muxes.values():
            mux.close()
        self._muxes.clear()

    async def adopt(self, worker: WorkerId, actor: Any, timeout_s: float) -> None:
        """Take `actor` as the new actor of a DEAD `worker` (a replacement): wait for its
        model, check it agrees with the others, index what it holds, follow its events, and
        make it HEALTHY. Raises on a failed start (the worker stays DEAD)."""
        state = self._workers[worker]
        assert state.health is Health.DEAD, "only a dead worker is replaced"
        info: WorkerInfo = await asyncio.wait_for(actor.info.remote(), timeout_s)
        if _agree([info]) != self.model:
            raise RuntimeError(f"the replacement of {worker} serves another model: {info}")
        await self._give_quotas(worker, actor)
        async with state.lock:
            state.actor, state.info, state.incarnation = actor, info, info.incarnation
            state.streamed = self.events.follows(worker, info.event_stream)
            state.load, state.missed_polls, state.stalled_s = WorkerLoad(), 0, 0.0
            await self._sync.resync(state)
        await self._sync.follow(state)
        state.num_replacements += 1
        self._healthy(state)

    async def _give_quotas(self, worker: WorkerId, actor: Any) -> None:
        """Give a joining worker the tenants' quotas (nothing when there are none)."""
        if self.quotas:
            await asyncio.wait_for(
                actor.set_quotas.remote(dict(self.quotas)), self.config.call_timeout_s
            )
            _log.info("worker %s has the quotas of %d tenants", worker, len(self.quotas))

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
        if failure is Failure.GONE and await off_loop(actor_state, state.actor) == "DEAD":
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
        self._sync.forget(worker)

    def _healthy(self, state: WorkerState) -> None:
        if self._hung(state):
            return  # it answers, but its engine is stuck: only a ping that says otherwise heals
        if state.health is not Health.HEALTHY:
            _log.warning("worker %s is healthy again", state.worker_id)
        state.health, state.failing_since, state.missed_polls = Health.HEALTHY, None, 0

    # ---- polls ------------------------------------------------------------------------------

    async def sync(self, worker: WorkerId) -> None:
        """Poll one worker now: its load, and its events into the index. When its events come
        through a stream, also wait (briefly) until the index holds every event the worker had
        made by the poll: a caller that has its answer then sees its blocks."""
        state = self._workers[worker]
        announced = await self.poll(state)
        if announced is not None and state.streamed:
            await self._sync.await_stream(state, announced)

    async def poll(self, state: WorkerState) -> int | None:
        """Load, incarnation check and (unless streamed) events of one worker; returns the
        worker's next event sequence number, None when the poll failed (no verdict: pings judge)."""
        if state.health is Health.DEAD:
            return None
        async with state.lock:  # events of one worker are applied in order
            since = self._sync.polled_since(state)
            try:
                result: PollResult = await asyncio.wait_for(
                    state.actor.poll.remote(since), self.config.call_timeout_s
                )
            except ray_error_types() as exc:
                self._poll_failed(state, exc)
                return None
            state.load = result.load
            self._healthy(state)
            await self._sync.apply_polled(state, result)
        return result.next_seq

    async def _catch_up(self, state: WorkerState) -> None:
        if await self._sync.catch_up(state):
            await self.poll(state)  # the index followed this life already: the newer events

    def missed(self, state: WorkerState, exc: BaseException) -> None:
        """A ping that failed; `max_missed_polls` in a row make the worker unhealthy (one that
        failed with the process gone counts at once)."""
        state.missed_polls += 1
        gone = classify(exc) is Failure.GONE
        if gone or state.missed_polls >= self.config.max_missed_polls:
            self.mark_unhealthy(state, f"{state.missed_polls} missed pings: {type(exc).__name__}")

    def answered(self, state: WorkerState, beat: Heartbeat) -> bool:
        """A ping that answered: the missed count is cleared (the process lives, however long
        its step). False, and the worker UNHEALTHY, when its engine or event loop has made no
        progress for `hang_after_s`: it answers, but it is stuck."""
        state.missed_polls, state.stalled_s = 0, beat.stalled_s
        if self._hung(state):
            self.mark_unhealthy(
                state,
                f"no progress for {beat.stalled_s:.0f} s (step {beat.step_s:.0f} s, "
                f"event loop {beat.loop_stall_s:.0f} s)",
            )
            return False
        return True

    def _hung(self, state: WorkerState) -> bool:
        return state.stalled_s > self.config.hang_after_s

    def _poll_failed(self, state: WorkerState, exc: BaseException) -> None:
        """A poll or snapshot that failed: no verdict on a worker that may be busy (its pings
        decide), unless the failure says its process is gone."""
        if classify(exc) is Failure.GONE:
            self.missed(state, exc)
        else:
            _log.debug("worker %s did not answer a poll: %s", state.worker_id, exc)


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
