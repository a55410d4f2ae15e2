"""Several async streams read as one, for the parts of a resumed multi-sample request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


async def merged(
    streams: Mapping[K, AsyncGenerator[T, None]], stop: Callable[[K], bool]
) -> AsyncGenerator[tuple[K, T], None]:
    """`(key, item)` of every stream, in the order items arrive. After an item of `key` is
    taken, `stop(key)` True closes that stream. The first error of any stream is raised here;
    closing the merged stream (or an error) closes every stream."""
    queue: asyncio.Queue[tuple[K, T | BaseException | None]] = asyncio.Queue()

    async def pump(key: K, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((key, item))
            queue.put_nowait((key, None))
        except Exception as exc:
            queue.put_nowait((key, exc))

    loop = asyncio.get_running_loop()
    tasks = {key: loop.create_task(pump(key, stream)) for key, stream in streams.items()}
    live = set(tasks)
    try:
        while live:
            key, item = await queue.get()
            if key not in live:
                continue  # what a stopped stream sent before it was closed
            if isinstance(item, BaseException):
                raise item
            if item is None:
                live.discard(key)
                continue
            yield key, item
            if stop(key):
                live.discard(key)
                tasks[key].cancel()
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
