"""A request's stream from its worker, as `WorkerPool.stream` gives it: over the worker's mux
(`router/pool/worker_mux.py`) or a Ray stream of its own, waited for as long as the worker
answers pings, failing over (`WorkerDied`) when it does not or when Ray says it failed, the
request cancelled on the worker when the stream is closed early."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.pool.ray_failures import ray_error_types
from router.pool.worker_errors import WorkerDied, raise_stream_error
from router.pool.worker_mux import MuxEnded, WorkerMux
from router.pool.worker_state import Health, WorkerState
from workers.protocol import CacheHints, HolderHint, StreamDelta, StreamError

_log = logging.getLogger(__name__)
T = TypeVar("T")


def _refused_to_queue(
    queue: asyncio.Queue[Any], worker: str, submitted: asyncio.Future[bool]
) -> None:
    """A `submit` that failed, or found its mux ended, ends its stream with the error."""
    if submitted.cancelled():
        return
    failure = submitted.exception()
    if failure is None and not submitted.result():
        failure = MuxEnded(f"{worker} has ended the mux")
    if failure is not None:
        queue.put_nowait(failure)


class StreamCalls:
    """Mixed into `WorkerPool`, which sets the attributes and `failed`."""

    config: RouterConfig
    _workers: dict[WorkerId, WorkerState]
    _muxes: dict[WorkerId, WorkerMux]

    failed: Callable[[WorkerId, BaseException], Awaitable[None]]  # `WorkerPool.failed`

    async def stream(
        self,
        worker: WorkerId,
        prompt_ids: list[int],
        params: dict[str, Any],
        request_id: str,
        cache_salt: str | None,
        holder: HolderHint | None = None,
        hold_kv: bool = False,
        cache: CacheHints | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Forward a request and stream its deltas; raises WorkerDied (the worker failed, or
        stopped answering pings while the stream waited), or the router's typed error for a
        refusal. Closing the iterator early cancels the request on the worker. `holder` names
        a worker with a longer prefix of the prompt to pull from; `hold_kv` tells the worker
        another will pull this prompt's KV (a hand-off's prefill); `cache`, the request's
        explicit cache controls (`router.request.cache_hints`)."""
        state = self._workers[worker]
        # The hint goes only when there is one, so a worker of an older build still answers.
        extra = () if holder is None else (holder,)
        kwargs: dict[str, Any] = {"hold_kv": True} if hold_kv else {}
        if cache is not None and cache != CacheHints():
            kwargs["cache"] = cache  # likewise: only when the request has controls
        args = (prompt_ids, params, request_id, cache_salt, *extra)
        if self.config.multiplex_streams and hasattr(state.actor, "open_mux"):
            deltas = self._muxed(state, args, kwargs)
        else:
            deltas = self._own_stream(state, args, kwargs)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    async def _own_stream(
        self, state: WorkerState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncGenerator[StreamDelta, None]:
        """The request on a Ray stream of its own (`WorkerActor.generate`)."""
        import ray

        actor, request_id = state.actor, args[2]
        gen = actor.generate.options(num_returns="streaming").remote(*args, **kwargs)
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
            await self.failed(state.worker_id, exc)
            raise WorkerDied(state.worker_id, started) from exc
        finally:
            if not done:
                ray.cancel(gen)
                actor.abort.remote(request_id)

    async def _muxed(
        self, state: WorkerState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncGenerator[StreamDelta, None]:
        """The request on the worker's mux (`router/pool/worker_mux.py`, `WorkerActor.submit`)."""
        worker, actor, request_id = state.worker_id, state.actor, args[2]
        mux = self._muxes.get(worker)
        if mux is None or mux.spent or mux.actor is not actor:
            if mux is not None:
                mux.close()
            mux = self._muxes[worker] = WorkerMux(actor)
        key, queue = mux.open()
        # Not awaited: its answer matters only when it is a failure, which then comes first.
        submitted = asyncio.ensure_future(actor.submit.remote(mux.mux_id, key, *args, **kwargs))
        submitted.add_done_callback(partial(_refused_to_queue, queue, f"worker {worker}"))
        started = done = False
        try:
            while True:
                item = (
                    queue.get_nowait()
                    if queue.qsize()
                    else await self._waited(state, queue.get(), started)
                )
                if item is None:
                    done = True
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamError):
                    done = True
                    if item.code == "unavailable":  # the worker failed the stream: fail over
                        _log.warning("worker %s failed a stream: %s", worker, item.message)
                        raise WorkerDied(worker, started)
                    raise_stream_error(item)
                started = True
                yield item
        except ray_error_types() as exc:
            done = True
            await self.failed(worker, exc)
            raise WorkerDied(worker, started) from exc
        except MuxEnded as exc:
            done = True
            raise WorkerDied(worker, started) from exc
        finally:
            mux.forget(key)
            submitted.cancel()
            if not done:  # also when the submit is still on its way
                actor.cancel_stream.remote(mux.mux_id, key, request_id)

    async def _next_ref(self, state: WorkerState, gen: Any, started: bool) -> Any:
        """The stream's next object ref, None at its end (`_waited`)."""
        try:
            return await self._waited(state, gen.__anext__(), started)
        except StopAsyncIteration:
            return None

    async def _waited(self, state: WorkerState, next_item: Awaitable[T], started: bool) -> T:
        """`next_item`'s result. A slow step is waited for as long as the worker answers pings;
        once the supervisor finds it unhealthy (frozen, or its process gone) the stream fails
        over instead of waiting for it."""
        pending = asyncio.ensure_future(next_item)
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
        return pending.result()
