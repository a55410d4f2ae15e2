"""The worker's side of a mux (`workers/mux.py`): the streams a step advanced leave as one batch,
each stream's items in order and then its end; a failing stream ends alone; closing cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from workers.mux import DeltaMux, MuxTable
from workers.protocol import MuxBatch, StreamDelta, StreamError


async def _stepped(
    step: asyncio.Condition, key: int, n: int, fail_at: int | None = None
) -> AsyncIterator[StreamDelta | StreamError]:
    """`n` deltas, one per step (as the engine's streams are woken by a step's end)."""
    for i in range(n):
        async with step:
            await step.wait()
        if i == fail_at:
            raise RuntimeError("a bug in the stream")
        yield StreamDelta(0, (key, i), f"{key}:{i}")


async def _collect(mux: DeltaMux, into: list[MuxBatch], ends: int) -> None:
    seen = 0
    async for batch in mux.batches():
        into.append(batch)
        seen += sum(item is None for _, item in batch)
        if seen == ends:
            return


async def _run_steps(step: asyncio.Condition, count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0.01)  # every stream waits for the step
        async with step:
            step.notify_all()


def test_a_steps_deltas_leave_as_one_batch_in_order_then_each_streams_end() -> None:
    async def scenario() -> list[MuxBatch]:
        mux, step, batches = DeltaMux(), asyncio.Condition(), []
        for key in range(4):
            mux.run(key, _stepped(step, key, 3))
        reader = asyncio.create_task(_collect(mux, batches, ends=4))
        await _run_steps(step, 3)
        await asyncio.wait_for(reader, 5)
        return batches

    batches = asyncio.run(scenario())
    assert len(batches) == 3  # one per step, not one per delta: 12 deltas and 4 ends
    for i, batch in enumerate(batches):
        deltas = [(k, d) for k, d in batch if d is not None]
        assert sorted(k for k, _ in deltas) == [0, 1, 2, 3]
        assert all(isinstance(d, StreamDelta) and d.token_ids == (k, i) for k, d in deltas)
    assert [(k, d) for k, d in batches[-1] if d is None] == [(k, None) for k in range(4)]


def test_a_failing_stream_ends_unavailable_and_the_others_go_on() -> None:
    async def scenario() -> list[MuxBatch]:
        mux, step, batches = DeltaMux(), asyncio.Condition(), []
        mux.run(0, _stepped(step, 0, 3, fail_at=1))
        mux.run(1, _stepped(step, 1, 3))
        reader = asyncio.create_task(_collect(mux, batches, ends=2))
        await _run_steps(step, 3)
        await asyncio.wait_for(reader, 5)
        return batches

    items = [pair for batch in asyncio.run(scenario()) for pair in batch]
    first = [item for key, item in items if key == 0]
    assert isinstance(first[0], StreamDelta) and first[0].token_ids == (0, 0)
    assert isinstance(first[1], StreamError) and first[1].code == "unavailable"
    assert "a bug in the stream" in first[1].message and first[2:] == [None]
    second = [item for key, item in items if key == 1]
    assert [d.token_ids for d in second[:-1] if isinstance(d, StreamDelta)] == [
        (1, i) for i in range(3)
    ]
    assert second[-1] is None


def test_closing_cancels_the_streams_and_ends_the_batches() -> None:
    closed: list[int] = []

    async def endless(key: int) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                yield StreamDelta(0, (key,), "")
                await asyncio.sleep(0.01)
        finally:
            closed.append(key)  # the actor's `generate` aborts its request here

    async def scenario() -> int:
        mux = DeltaMux()
        for key in (0, 1):
            mux.run(key, endless(key))
        batches = 0
        async for _ in mux.batches():
            batches += 1
            if batches == 3:
                mux.close()
        await asyncio.sleep(0.05)
        return batches

    assert asyncio.run(scenario()) >= 3
    assert sorted(closed) == [0, 1]


def test_a_mux_is_one_whoever_asks_first_and_none_once_ended() -> None:
    async def scenario() -> None:
        table = MuxTable()
        mux = table.get("router-a")
        assert mux is not None and table.get("router-a") is mux  # the other call finds it
        assert table.get("router-b") is not mux
        table.end("router-a")
        assert table.get("router-a") is None  # a late submit is refused, not parked
        table.end_all()
        assert table.get("router-b") is None

    asyncio.run(scenario())


def test_a_stream_cancelled_before_it_came_never_runs_and_one_running_is_closed() -> None:
    started: list[int] = []
    closed: list[int] = []

    async def deltas(key: int) -> AsyncIterator[StreamDelta]:
        started.append(key)
        try:
            while True:
                yield StreamDelta(0, (key,), "")
                await asyncio.sleep(0.01)
        finally:
            closed.append(key)

    async def scenario() -> None:
        mux = DeltaMux()
        mux.cancel(7)  # the router's cancel overtook the submit
        mux.run(7, deltas(7))
        mux.run(8, deltas(8))
        await asyncio.sleep(0.05)
        mux.cancel(8)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert started == [8] and closed == [8]
