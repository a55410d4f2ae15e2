"""Many streams of a worker over one Ray stream: what every request of one router got from a
step, sent as one item.

A Ray streaming call per request costs the worker CPU for every item it yields (the object is
stored and reported to its owner on its own), and the router CPU again to take it: at 16
streams that is 16 items a step, whose CPU on a small machine comes out of the step's own cores
(docs/benchmarks/serve.md measures it). A router instead opens one `DeltaMux` per worker
(`WorkerActor.open_mux`) and `submit`s its requests to it; their deltas, keyed by a number the
router chose, are gathered here and leave as one batch per step, since every stream a step
advanced is woken by that step and pushes its delta before the mux's reader runs again.

The worker side only: the router's is `router/pool/worker_mux.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

from workers.protocol import MuxBatch, StreamDelta, StreamError

_log = logging.getLogger(__name__)


class DeltaMux:
    """The streams of one router on this worker; create and use on the actor's event loop."""

    def __init__(self) -> None:
        self._items: MuxBatch = []
        self._ready = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}  # by key, while running
        self._dropped: deque[int] = deque(maxlen=1024)  # keys cancelled before they ran
        self._closed = False

    def run(self, key: int, deltas: AsyncIterator[StreamDelta | StreamError]) -> None:
        """Send every item of `deltas` under `key`, then the stream's end (`None`). An
        exception it raises ends the stream with an "unavailable" error: the router treats the
        request as one a failing worker dropped, as it treats a failed Ray call. Nothing runs
        when `key` was cancelled already."""
        if key in self._dropped:
            return
        task = asyncio.get_running_loop().create_task(self._pump(key, deltas))
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    def cancel(self, key: int) -> None:
        """Stop the stream `key` (its request is aborted as the stream closes), or, when it has
        not come yet, keep it from running: the router's cancel may overtake its `submit`."""
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()
        else:
            self._dropped.append(key)

    async def batches(self) -> AsyncIterator[MuxBatch]:
        """Every batch of items, in the order they were pushed, until `close`."""
        while not self._closed:
            await self._ready.wait()
            self._ready.clear()
            items, self._items = self._items, []
            if items:
                yield items

    def close(self) -> None:
        """End `batches` and cancel the streams still running (their requests are aborted)."""
        self._closed = True
        self._ready.set()
        for task in list(self._tasks.values()):
            task.cancel()

    async def _pump(self, key: int, deltas: AsyncIterator[StreamDelta | StreamError]) -> None:
        try:
            async for item in deltas:
                self._push(key, item)
        except Exception as exc:  # a bug: fail this stream, never the mux's others
            _log.exception("a multiplexed stream failed")
            self._push(key, StreamError("unavailable", f"the worker failed the stream: {exc}"))
        self._push(key, None)  # not when cancelled: the mux is closing, no one reads it

    def _push(self, key: int, item: StreamDelta | StreamError | None) -> None:
        self._items.append((key, item))
        self._ready.set()


class MuxTable:
    """A worker's open muxes by the routers' ids, and the ids of the last ones that ended."""

    def __init__(self) -> None:
        self._open: dict[str, DeltaMux] = {}
        self._ended: deque[str] = deque(maxlen=1024)

    def get(self, mux_id: str) -> DeltaMux | None:
        """The mux `mux_id`, opened now when new; None when it has ended. Either `open_mux` or
        a `submit` may ask first: that a streaming call's first step runs before the caller's
        next call is not promised."""
        if mux_id in self._ended:
            return None
        return self._open.setdefault(mux_id, DeltaMux())

    def find(self, mux_id: str) -> DeltaMux | None:
        """The open mux `mux_id`, if there is one (none is opened)."""
        return self._open.get(mux_id)

    def end(self, mux_id: str) -> None:
        """Close the mux `mux_id` (its streams are cancelled); a later `get` answers None."""
        mux = self._open.pop(mux_id, None)
        if mux is not None:
            self._ended.append(mux_id)
            mux.close()

    def end_all(self) -> None:
        for mux_id in list(self._open):
            self.end(mux_id)
