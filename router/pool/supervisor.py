"""Keeps the worker pool true to life: pings and polls each worker on its own task, turns a
worker that stopped answering into UNHEALTHY (so its streams fail over), one that Ray says is
dead, or that failed for `dead_after_s`, into DEAD, and replaces a DEAD worker with a new actor
when it was given a way to (`replace`), with exponential backoff and a cap.

A ping (`WorkerActor.ping`) is answered on a thread of the actor's own, never behind a step
or the actor's event loop, so a long step never looks like a hang: an answered ping clears the
missed count. A frozen process (SIGSTOP, a stuck node) misses `max_missed_polls` pings of
`ping_timeout_s` in a row; a process that answers but whose engine step or event loop has not
moved for `hang_after_s` is stuck. Either is UNHEALTHY. State changes are logged once each (the
pool's `mark_*`), never once per failed poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.pool.ray_failures import actor_state, kill, off_loop, ray_error_types
from router.pool.worker_pool import Health, WorkerPool, WorkerState

_log = logging.getLogger(__name__)
_MAX_BACKOFF_S = 60.0

# Starts a new actor for a worker id and returns its handle (blocking: run in a thread).
Replace = Callable[[WorkerId], Any]


class Supervisor:
    """One watch task per worker; `close` stops them (the actors are left running)."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, replace: Replace | None) -> None:
        self.pool = pool
        self.config = config
        self.replace = replace
        self._wakes: dict[WorkerId, asyncio.Event] = {}  # per watch: poll now (`poll_soon`)
        self.num_replacements = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(s)) for s in self.pool.states()]

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop watching; a watch stuck in a thread (a Ray call) is not waited for longer
        than `timeout_s`."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=timeout_s)
            if stuck:
                _log.warning("%d worker watches did not stop in time", len(stuck))
        self._tasks = []

    async def _watch(self, state: WorkerState) -> None:
        backoff = self.config.replace_backoff_s
        while True:
            if state.health is Health.DEAD:
                if not await self._try_replace(state):
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, _MAX_BACKOFF_S)
                    continue
                backoff = self.config.replace_backoff_s
            try:
                await self._check(state)
            except Exception:  # the watch must outlive any one failure
                _log.exception("watching worker %s failed", state.worker_id)
            await self._pause(state)

    def poll_soon(self, worker: WorkerId) -> None:
        """Ping and poll `worker` now rather than at its next round (e.g. a request's prompt
        was just computed there: its blocks reach the index at once, while the rounds of a
        busy worker are `busy_poll_interval_s` apart). Rounds asked for meanwhile are one."""
        wake = self._wakes.get(worker)
        if wake is not None:
            wake.set()

    async def _pause(self, state: WorkerState) -> None:
        """Until the next round: longer while the worker has requests, whose steps each round
        of Ray calls takes CPU from; cut short by `poll_soon`."""
        interval = self.config.poll_interval_s
        if state.num_requests > 0:
            interval = max(interval, self.config.busy_poll_interval_s)
        wake = self._wakes.setdefault(state.worker_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval)
        wake.clear()

    async def _check(self, state: WorkerState) -> None:
        """Ping, then poll when the ping answered and the worker is not stuck; settle a
        failing worker's fate."""
        try:
            beat = await asyncio.wait_for(state.actor.ping.remote(), self.config.ping_timeout_s)
        except ray_error_types() as exc:
            self.pool.missed(state, exc)
        else:
            if self.pool.answered(state, beat):
                await self.pool.poll(state)
        if state.health is Health.UNHEALTHY:
            await self._settle(state)

    async def _settle(self, state: WorkerState) -> None:
        """DEAD when Ray says the actor is dead, or when it has failed for `dead_after_s`
        (then it is killed, so that a late recovery cannot serve from a stale index)."""
        if await off_loop(actor_state, state.actor) == "DEAD":
            self.pool.mark_dead(state.worker_id, "its actor is dead")
            return
        since = state.failing_since
        if since is not None and time.monotonic() - since > self.config.dead_after_s:
            await off_loop(kill, state.actor)
            self.pool.mark_dead(
                state.worker_id, f"unhealthy for more than {self.config.dead_after_s:.0f} s"
            )

    async def _try_replace(self, state: WorkerState) -> bool:
        """Start a new actor for a DEAD worker; False when there is no way to, the cap is
        reached, or the start failed (retried after a backoff)."""
        if self.replace is None or state.num_replacements >= self.config.max_replacements:
            return False
        worker = state.worker_id
        _log.warning("replacing worker %s", worker)
        try:
            actor = await off_loop(self.replace, worker)
            await self.pool.adopt(worker, actor, self.config.start_timeout_s)
        except Exception as exc:
            _log.warning("replacing worker %s failed: %s", worker, exc)
            return False
        self.num_replacements += 1
        return True
