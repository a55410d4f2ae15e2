"""`cachesvc bench step --ray-stream`: what shipping one decode step's deltas through Ray costs
the worker's actor, per sequence, beside one message for the whole step.

A real local Ray actor holds `batch` open streaming calls, as `WorkerActor.generate` does (one
per request, `num_returns="streaming"`), and at each step hands every stream one `StreamDelta`
of one token; the step ends when every stream has yielded its delta. Beside it, `one_stream`:
one streaming call that yields the step's deltas as one list (one message per step, as vLLM's
engine core sends its front end). The driver consumes the streams as the router does (awaiting
each item). Per step: the actor's wall time from handing out the deltas to the last yield, and
its process's CPU time over the same span (Ray's own threads included), median of the steps.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cachesvc.workloads.table import format_table, write_json
from workers.protocol import StreamDelta

MODES = ("per_request", "one_stream")
_WARMUP_STEPS = 3


class StreamActor:
    """The streaming half of `WorkerActor.generate`, with no engine behind it."""

    def __init__(self) -> None:
        self._queues: list[asyncio.Queue[Any]] = []
        self._yielded = 0
        self._target = 0
        self._done: asyncio.Event | None = None

    async def stream(self, steps: int) -> AsyncIterator[Any]:
        """Yield what `drive` hands this stream, `steps` times."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues.append(queue)
        for _ in range(steps):
            yield await queue.get()
            self._yielded += 1  # Ray asks for the next item once this one is sent
            if self._done is not None and self._yielded >= self._target:
                self._done.set()

    async def drive(self, num_streams: int, batch: int, steps: int) -> list[tuple[float, float]]:
        """Hand out `steps` steps of `batch` deltas over the open streams (one each, or all
        in one list to a single stream); (wall s, CPU s) of each step until all were yielded."""
        while len(self._queues) < num_streams:
            await asyncio.sleep(0.001)
        self._done = asyncio.Event()
        spans = []
        for step in range(steps):
            self._done.clear()
            self._target = self._yielded + num_streams
            wall, cpu = time.perf_counter(), time.process_time()
            deltas = [StreamDelta(0, (step,), " tok") for _ in range(batch)]
            if num_streams == batch:
                for queue, delta in zip(self._queues, deltas, strict=True):
                    queue.put_nowait(delta)
            else:
                self._queues[0].put_nowait(deltas)
            await self._done.wait()
            spans.append((time.perf_counter() - wall, time.process_time() - cpu))
        return spans


async def _consume(gen: Any) -> None:
    async for ref in gen:
        await ref


async def _run(actor: Any, mode: str, batch: int, steps: int) -> list[tuple[float, float]]:
    num_streams = batch if mode == "per_request" else 1
    gens = [actor.stream.options(num_returns="streaming").remote(steps) for _ in range(num_streams)]
    spans = actor.drive.remote(num_streams, batch, steps)
    await asyncio.gather(*(_consume(g) for g in gens))
    result: list[tuple[float, float]] = await spans
    return result[_WARMUP_STEPS:]


def run_stream_bench(batches: Sequence[int], steps: int, json_path: str | None) -> int:
    """Print the table (and write JSON); returns 0."""
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=2)
    records = []
    try:
        remote = ray.remote(StreamActor)
        for batch in batches:
            for mode in MODES:
                actor: Any = remote.remote()  # a fresh actor: its streams are this cell's alone
                spans = asyncio.run(_run(actor, mode, batch, steps + _WARMUP_STEPS))
                ray.kill(actor)
                wall = 1e3 * statistics.median(s[0] for s in spans)
                cpu = 1e3 * statistics.median(s[1] for s in spans)
                records.append(
                    {"batch": batch, "mode": mode, "steps": len(spans), "wall_ms": wall,
                     "cpu_ms": cpu, "cpu_us_per_seq": 1e3 * cpu / batch}
                )  # fmt: skip
                print(f"batch {batch} {mode}: done", flush=True)
    finally:
        ray.shutdown()
    report = {"cells": records}
    print("one step's deltas through Ray (a local actor), median of the steps:")
    rows = [
        [r["batch"], r["mode"], f"{r['wall_ms']:.2f}", f"{r['cpu_ms']:.2f}",
         f"{r['cpu_us_per_seq']:.1f}"]
        for r in records
    ]  # fmt: skip
    print(format_table(["batch", "mode", "wall ms", "actor CPU ms", "CPU us a sequence"], rows))
    write_json(json_path, report)
    return 0
