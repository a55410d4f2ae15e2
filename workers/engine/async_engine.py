"""An asyncio front for the Engine: many concurrent streams over one step loop.

The Engine is not thread-safe. A background task runs `engine.step()` in a worker thread (always
the same one) only while requests are unfinished, so the event loop stays free to accept and
stream. Every other touch of the engine (adding, aborting, reading counters) happens on the
loop thread *between* steps: when no step is running it happens at once, otherwise it is queued
and applied as soon as the step returns.

Nothing that only reads waits for a step: the load is measured in the step's own thread at its
end (its cached-prefix walk over the waiting queue never runs on the loop), and `busy_s` says,
from any thread, how long the running step has run, so a liveness check can tell a long step
from a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from cachesvc.kv.types import RequestId
from workers.engine.engine import Engine
from workers.engine.load import EngineLoad, measure_load
from workers.engine.outputs import RequestFailed, RequestOutput
from workers.engine.request import PeerSource
from workers.protocol import CacheHints
from workers.sampling_params import SamplingParams

T = TypeVar("T")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Aborted:
    """Queued for a stream whose request was aborted by `abort` (the engine reports nothing)."""

    request_id: RequestId


def _aborted_output(
    last: RequestOutput | None, request_id: RequestId, prompt: str | Sequence[int]
) -> RequestOutput:
    if last is not None:
        return replace(last, delta_text="", finished=True, finish_reason="abort")
    prompt_ids = () if isinstance(prompt, str) else tuple(prompt)
    return RequestOutput(request_id, prompt_ids, (), "", "", True, "abort", None, None, 0, 0, 0)


_Item = RequestOutput | _Aborted | BaseException


def _coalesced(item: _Item, queue: asyncio.Queue[_Item], held: deque[_Item]) -> _Item:
    """`item` merged with the snapshots of the same sample queued right behind it (the latest
    snapshot, with every merged `delta_text` in order); the first item that cannot merge is
    put in `held`. Errors, aborts and exceptions never merge."""
    if not isinstance(item, RequestOutput) or item.error is not None:
        return item
    while not held and not queue.empty():
        nxt = queue.get_nowait()
        if not (
            isinstance(nxt, RequestOutput)
            and nxt.request_id == item.request_id
            and nxt.error is None
        ):
            held.append(nxt)
            break
        item = replace(nxt, delta_text=item.delta_text + nxt.delta_text)
    return item


class AsyncEngine:
    """Serves `generate` streams concurrently over one Engine; create and use on one loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._busy = False  # a worker thread is inside the engine
        self._deferred: deque[tuple[Callable[[], Any], asyncio.Future[Any] | None]] = deque()
        self._exclusive: deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._streams: dict[RequestId, asyncio.Queue[_Item]] = {}
        self._groups: dict[str, list[RequestId]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._load = measure_load(engine)
        self._stale = False  # requests came or went since `_load` was measured
        self._boundary_hooks: list[Callable[[Engine], None]] = []
        # Written on the loop thread, read from any (a ping's): one attribute, set whole.
        self._busy_since: float | None = None  # monotonic start of the running step
        # Every engine call on one thread: each thread entering torch's OpenMP regions gets a
        # team of its own, and with asyncio.to_thread's pool five threads shared two cores.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        tokenizer = engine.tokenizer
        if tokenizer is not None:  # the detokenizer's table (~0.1 s), built before a request
            self._thread.submit(lambda: tokenizer.byte_pieces)

    # ---- public API -------------------------------------------------------------------------

    @property
    def load(self) -> EngineLoad:
        """Counters as of the last step boundary (counts: of the last change); never blocks."""
        return self._load

    @property
    def busy_s(self) -> float:
        """How long the running step (or exclusive run) has run, 0.0 between steps: what a
        hang looks like from outside. Never blocks; may be read from any thread (a ping's)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def at_boundary(self, hook: Callable[[Engine], None]) -> None:
        """Run `hook(engine)` on the loop thread after every step and exclusive run (e.g. to
        collect what the step changed); a hook that raises is logged, never fatal."""
        self._boundary_hooks.append(hook)

    def try_call(self, fn: Callable[[Engine], Any]) -> bool:
        """Run a short `fn(engine)` now when no step is running, and say whether it ran;
        never waits (what a running step changes reaches the `at_boundary` hooks)."""
        if self._busy:
            return False
        fn(self.engine)
        return True

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        peer: PeerSource | None = None,
        coalesce: bool = False,
        cache: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of a request (of each of its `params.n` samples, interleaved).

        `coalesce`: when steps came faster than the consumer reads, the snapshots of a sample
        waiting one after another are handed over as one (the latest, its `delta_text` all of
        theirs), so that a consumer that pays per item (a Ray stream: ~0.3 ms of the actor's
        CPU an item) falls behind by fewer items, not more (vLLM's output collector does so).

        Raises the engine's PromptError / ValueError before yielding anything when the prompt is
        unusable, and RequestFailed when the engine failed this request (any of its samples: the
        others are aborted) while serving it; the other streams go on. Closing or cancelling the
        iterator early aborts the request and frees its blocks. A model run that raises fails
        no stream at once: the engine runs the batch's requests alone to find the one that
        breaks it, whose stream then raises RequestFailed (`workers.engine.suspects`); when runs
        fail whatever request they hold (the worker is at fault), every open stream raises the
        run's error.
        """
        base = request_id or f"req-{uuid.uuid4().hex[:12]}"
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        rids = await self.call(
            lambda e: self._add(e, prompt, params, base, cache_salt, peer, queue, cache)
        )
        remaining = set(rids)
        last: dict[RequestId, RequestOutput] = {}
        held: deque[_Item] = deque()  # taken off the queue while coalescing, not yet handled
        try:
            while remaining:
                item = held.popleft() if held else await queue.get()
                if coalesce:
                    item = _coalesced(item, queue, held)
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput) and item.error is not None:
                    remaining.discard(item.request_id)  # the engine dropped it already
                    raise RequestFailed(item.request_id, item.error)
                if isinstance(item, _Aborted):
                    if item.request_id not in remaining:
                        continue  # it had finished before the abort arrived
                    item = _aborted_output(last.get(item.request_id), item.request_id, prompt)
                if item.finished:
                    remaining.discard(item.request_id)
                last[item.request_id] = item
                yield item
        finally:
            for rid in rids:
                self._streams.pop(rid, None)
            self._groups.pop(base, None)
            if remaining:
                unfinished = sorted(remaining)
                self._call_soon(lambda: self._abort_all(unfinished))

    async def abort(self, request_id: str) -> None:
        """Abort a request (all samples of a `generate` call given its id); unknown ids are
        ignored. Its stream ends with an `abort` finish reason."""
        rids = self._groups.get(request_id) or [RequestId(request_id)]
        await self.call(lambda e: self._abort_all(rids))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run a short `fn(engine)` on the loop thread between steps and return its result."""
        self._ensure_started()
        if not self._busy:
            return fn(self.engine)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._deferred.append((lambda: fn(self.engine), future))
        return await future

    async def run_exclusive(self, fn: Callable[[Engine], T]) -> T:
        """Run a long `fn(engine)` (e.g. a scoring pass) in a worker thread between steps."""
        self._ensure_started()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._exclusive.append((lambda: fn(self.engine), future))
        self._wake.set()
        return await future

    async def shutdown(self) -> None:
        """Stop the step loop; streams still open raise RuntimeError."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # A step may still be running in its thread: end the streams without touching the engine.
        self._fail_all(RuntimeError("the engine was shut down"), abort=False)
        self._thread.shutdown(wait=False)  # a running step finishes on its own

    # ---- on the loop thread -----------------------------------------------------------------

    def _add(
        self,
        engine: Engine,
        prompt: str | Sequence[int],
        params: SamplingParams,
        base: str,
        cache_salt: str | None,
        peer: PeerSource | None,
        queue: asyncio.Queue[_Item],
        cache: CacheHints | None = None,
    ) -> list[RequestId]:
        rids = engine.add_request(prompt, params, base, cache_salt, peer, cache)
        for rid in rids:
            self._streams[rid] = queue
        self._groups[base] = rids
        self._recount()
        return rids

    def _abort_all(self, rids: Sequence[RequestId]) -> None:
        for rid in rids:
            self.engine.abort(rid)
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(_Aborted(rid))
        self._recount()

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        # Used from `finally` blocks, which must not await: run now or right after the step.
        if not self._busy:
            fn()
        else:
            self._deferred.append((fn, None))

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._run_deferred()
            if self._exclusive:
                fn, future = self._exclusive.popleft()
                await self._run_one_exclusive(fn, future)
            elif self.engine.has_unfinished():
                await self._step()
            elif self._stale:  # requests went while idle: measure what is left, off the loop
                self._stale = False
                await self._in_thread(lambda: None)
            else:
                self._wake.clear()
                await self._wake.wait()

    async def _step(self) -> None:
        self._stale = False  # the step's thread measures every request added so far
        try:
            outputs = await self._in_thread(self.engine.step)
        except Exception as exc:  # model runs failed whatever request they held (Engine.step
            # undid the step): the worker is at fault, so every stream ends with the error
            _log.exception("engine step failed")
            self._fail_all(exc)
            return
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self._boundary()

    async def _run_one_exclusive(self, fn: Callable[[], Any], future: asyncio.Future[Any]) -> None:
        self._stale = False
        try:
            result = await self._in_thread(fn)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(result)
        self._boundary()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a worker thread, then measure the load there too (the engine is still
        the thread's alone); when `fn` raises, the load is measured later."""

        def run() -> tuple[T, EngineLoad]:
            result = fn()
            return result, measure_load(self.engine)

        self._busy, self._busy_since = True, time.monotonic()
        try:
            loop = asyncio.get_running_loop()
            result, self._load = await loop.run_in_executor(self._thread, run)
            return result
        except BaseException:
            self._stale = True
            raise
        finally:
            self._busy, self._busy_since = False, None

    def _run_deferred(self) -> None:
        while self._deferred:
            fn, future = self._deferred.popleft()
            if future is not None and future.cancelled():
                continue  # the caller gave up (e.g. a stream cancelled before its add ran)
            try:
                result = fn()
            except Exception as exc:
                if future is None:
                    _log.exception("deferred engine call failed")
                elif not future.done():
                    future.set_exception(exc)
            else:
                if future is not None and not future.done():
                    future.set_result(result)

    def _fail_all(self, exc: BaseException, abort: bool = True) -> None:
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(exc)
            if abort:
                self.engine.abort(rid)
        self._streams.clear()
        if abort:
            self._recount()

    def _boundary(self) -> None:
        for hook in self._boundary_hooks:
            try:
                hook(self.engine)
            except Exception:
                _log.exception("a step-boundary hook failed")

    def _recount(self) -> None:
        """Requests came or went between steps: count them now (cheap, so admission stays
        exact) and leave the queued tokens to be measured off the loop."""
        engine = self.engine
        self._load = replace(
            self._load,
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_free_blocks=engine.pool.num_free,
            num_cached_blocks=engine.pool.num_cached,
        )
        self._stale = True
        self._wake.set()
