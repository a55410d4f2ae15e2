"""One worker's streams for this router over one Ray stream (`WorkerActor.open_mux`).

A Ray streaming call per request costs both processes CPU for every item, and on a small
machine that CPU comes out of the worker's steps. With a mux the worker sends what a step gave
every stream of this router as one item (`workers/mux.py`); the mux's reader hands each stream
its items through a queue of its own, under a key the router chose when it `open`ed the stream.

When the mux's Ray stream fails, every stream still open gets its error; when it ends (the
worker closed), they get `MuxEnded`. Either way the mux is spent: the pool opens a new one for
the next request (`WorkerPool.stream`). Ray is imported inside the methods only.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from workers.protocol import StreamDelta, StreamError

MuxItem = StreamDelta | StreamError | None | BaseException  # None: the stream's end


class MuxEnded(Exception):
    """The worker ended the mux (it closed) while a stream was open."""


class WorkerMux:
    """The streams of one worker's actor; create and use on the router's event loop."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.mux_id = uuid.uuid4().hex
        self._queues: dict[int, asyncio.Queue[MuxItem]] = {}
        self._next_key = 0
        self.num_batches = self.num_items = 0  # taken off the Ray stream: items per batch
        self._gen = actor.open_mux.options(num_returns="streaming").remote(self.mux_id)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def spent(self) -> bool:
        """Whether the mux's Ray stream ended or failed: open no stream on it."""
        return self._reader.done()

    def open(self) -> tuple[int, asyncio.Queue[MuxItem]]:
        """A new stream's key (for `submit`) and the queue its items arrive on."""
        key, self._next_key = self._next_key, self._next_key + 1
        queue: asyncio.Queue[MuxItem] = asyncio.Queue()
        self._queues[key] = queue
        return key, queue

    def forget(self, key: int) -> None:
        """The stream `key` is over here: items still coming for it are dropped."""
        self._queues.pop(key, None)

    def close(self) -> None:
        """Stop reading and cancel the Ray stream (the worker aborts the streams still open)."""
        import ray

        self._reader.cancel()
        ray.cancel(self._gen)

    async def _read(self) -> None:
        failure: BaseException
        try:
            async for ref in self._gen:
                batch = await ref
                self.num_batches, self.num_items = self.num_batches + 1, self.num_items + len(batch)
                for key, item in batch:
                    queue = self._queues.get(key)
                    if queue is not None:
                        queue.put_nowait(item)
            failure = MuxEnded(f"the worker ended mux {self.mux_id}")
        except asyncio.CancelledError:
            failure = MuxEnded("the router closed the mux")
            self._fail(failure)
            raise
        except Exception as exc:  # a Ray error: the worker died or cannot be reached
            failure = exc
        self._fail(failure)

    def _fail(self, failure: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(failure)
