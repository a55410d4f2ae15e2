"""AsyncEngine on a tiny random Llama: concurrent streams equal the offline engine, and every
way a stream can end early (break, cancel, abort, bad prompt) frees the request's blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from cachesvc.kv.types import RequestId
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine, PromptError
from workers.engine.outputs import RequestOutput
from workers.sampling_params import SamplingParams

T = TypeVar("T")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 13, 21, 40)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=128))


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    return [list(o.token_ids) for o in engine.generate(_prompts(), GREEDY)]


def _run(engine: Engine, body: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Run `body` on a fresh AsyncEngine, then check that nothing leaked."""

    async def main() -> T:
        aengine = AsyncEngine(engine)
        try:
            result = await body(aengine)
            await _settle(aengine)
        finally:
            await aengine.shutdown()
        return result

    result = asyncio.run(main())
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()
    return result


async def _settle(aengine: AsyncEngine) -> None:
    # Aborts of a cancelled stream are applied at the next step boundary.
    for _ in range(200):
        if await aengine.call(lambda e: not e.has_unfinished()):
            return
        await asyncio.sleep(0.01)


async def _collect(aengine: AsyncEngine, prompt: Any, params: SamplingParams) -> list[Any]:
    return [out async for out in aengine.generate(prompt, params)]


def test_concurrent_streams_equal_offline_greedy(engine: Engine, reference: list[list[int]]):
    async def body(aengine: AsyncEngine) -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(_collect(aengine, p, GREEDY) for p in _prompts())))

    streams = _run(engine, body)
    assert [list(s[-1].token_ids) for s in streams] == reference
    for stream in streams:
        # Snapshots grow one token at a time and only the last is finished.
        assert [len(o.token_ids) for o in stream] == list(range(1, len(stream) + 1))
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]


def test_n_samples_stream_interleaved(engine: Engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    outs = _run(engine, lambda a: _collect(a, _prompts()[1], params))
    finals = {o.request_id: o for o in outs if o.finished}
    assert len(finals) == 3
    assert all(len(o.token_ids) == 6 for o in finals.values())


def test_breaking_out_of_a_stream_aborts_it(engine: Engine):
    async def body(aengine: AsyncEngine) -> int:
        seen = 0
        async for _ in aengine.generate(_prompts()[3], LONG):
            seen += 1
            if seen == 2:
                break
        return seen

    assert _run(engine, body) == 2


def test_cancelling_the_consumer_aborts_the_request(engine: Engine):
    async def body(aengine: AsyncEngine) -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in aengine.generate(_prompts()[2], LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(engine, body)


def test_abort_ends_the_stream_with_abort(engine: Engine):
    async def body(aengine: AsyncEngine) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        async for out in aengine.generate(_prompts()[0], LONG, request_id="victim"):
            outs.append(out)
            if len(outs) == 3:
                await aengine.abort("victim")
        return outs

    outs = _run(engine, body)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) >= 3


def test_bad_prompt_raises_before_streaming(engine: Engine):
    async def body(aengine: AsyncEngine) -> None:
        with pytest.raises(PromptError):
            await _collect(aengine, [1, 2, 10_000], GREEDY)
        # The engine keeps serving after a refusal.
        outs = await _collect(aengine, _prompts()[0], GREEDY)
        assert outs[-1].finished

    _run(engine, body)


def test_stats_and_calls_between_steps(engine: Engine):
    async def body(aengine: AsyncEngine) -> None:
        stream = aengine.generate(_prompts()[3], LONG)
        await stream.__anext__()
        load = aengine.load
        assert load.num_running == 1 and load.num_free_blocks < load.num_blocks
        # A call issued while a step runs is applied at the next boundary, never concurrently.
        results = await asyncio.gather(*(aengine.call(lambda e: e.pool.num_free) for _ in range(5)))
        assert all(r <= load.num_blocks for r in results)
        await stream.aclose()

    _run(engine, body)


def test_queued_work_leaves_out_prefixes_the_pool_holds(engine: Engine):
    from workers.engine.load import measure_load as _measure

    prompt = _prompts()[3]  # 40 tokens: ten blocks of 4
    engine.generate([prompt], GREEDY)  # its blocks stay cached after it finishes
    cold = [(t + 1) % 320 for t in prompt]
    engine.add_request(prompt + [1, 2], GREEDY, request_id="hit")
    engine.add_request(cold, GREEDY, request_id="cold")
    try:
        hit, cold_req = engine.scheduler.waiting
        assert engine.kv.num_cached_prefix_tokens(hit) == 40
        assert engine.kv.num_cached_prefix_tokens(cold_req) == 0
        assert _measure(engine).num_queued_tokens == 2 + len(cold)
    finally:
        engine.abort(RequestId("hit"))
        engine.abort(RequestId("cold"))
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_running_step_blocks_no_reader_and_shows_in_busy_s(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
):
    # The step is held in its thread by an event: a step as long as the test wants.
    release = threading.Event()
    execute = engine.runner.execute

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never released the step"
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", held)
    boundaries: list[int] = []

    async def body(aengine: AsyncEngine) -> None:
        aengine.at_boundary(lambda e: boundaries.append(len(e.scheduler.running)))
        stream = aengine.generate(_prompts()[1], GREEDY)
        first = asyncio.ensure_future(stream.__anext__())
        while aengine.busy_s == 0.0:  # the step starts (and then stays) in its thread
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        # Read from another thread, as a ping is: the step shows, nothing waits for it.
        busy_s = await asyncio.to_thread(lambda: aengine.busy_s)
        assert busy_s > 0.0 and not first.done()
        assert aengine.try_call(lambda e: None) is False
        assert aengine.load.num_waiting + aengine.load.num_running == 1
        assert boundaries == []
        release.set()
        assert (await first).token_ids
        assert boundaries and boundaries[0] == 1  # the hook ran at the step's end
        await stream.aclose()

    _run(engine, body)


def test_the_load_s_cached_prefix_walk_never_runs_on_the_event_loop(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
):
    threads: set[int] = set()
    num_free_tokens = engine.kv.num_free_tokens

    def spy(request: Any) -> int:
        threads.add(threading.get_ident())
        return num_free_tokens(request)

    monkeypatch.setattr(engine.kv, "num_free_tokens", spy)

    async def body(aengine: AsyncEngine) -> int:
        loop_thread = threading.get_ident()
        streams = [_collect(aengine, p, GREEDY) for p in _prompts()]
        await asyncio.gather(*streams)
        # An abort leaves the load stale: it is measured off the loop too. A second request
        # stays, so that every measurement after the abort walks a request (with none left
        # the walk has nothing to call, whichever thread measures).
        stays = aengine.generate(_prompts()[2], LONG, request_id="stays")
        gone = aengine.generate(_prompts()[3], LONG, request_id="gone")
        await stays.__anext__()
        await gone.__anext__()
        threads.clear()
        await aengine.abort("gone")
        async for _ in gone:
            pass
        for _ in range(500):  # the aborted request leaves the load, measured later
            if aengine.load.num_running + aengine.load.num_waiting == 1 and threads:
                break
            await asyncio.sleep(0.01)
        assert aengine.load.num_running + aengine.load.num_waiting == 1
        await aengine.abort("stays")
        async for _ in stays:
            pass
        for _ in range(500):
            if aengine.load.num_queued_tokens == 0:
                break
            await asyncio.sleep(0.01)
        assert aengine.load.num_queued_tokens == 0
        return loop_thread

    loop_thread = _run(engine, body)
    assert threads and loop_thread not in threads


def test_every_step_runs_on_one_thread_off_the_loop(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
):
    # Each thread entering torch's parallel regions gets an OpenMP team of its own: steps on
    # several pool threads left several teams spinning against each other on two cores.
    threads: list[int] = []
    step = engine.step

    def spy() -> list[RequestOutput]:
        threads.append(threading.get_ident())
        return step()

    monkeypatch.setattr(engine, "step", spy)

    async def body(aengine: AsyncEngine) -> int:
        loop_thread = threading.get_ident()
        # The worker's own calls to asyncio.to_thread leave the loop's pool several threads,
        # which would take turns at the steps.
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(3)))
        for prompt in _prompts():
            await _collect(aengine, prompt, GREEDY)
            await asyncio.sleep(0.01)
        await aengine.call(lambda e: None)
        return loop_thread

    loop_thread = _run(engine, body)
    assert len(threads) >= 4 * GREEDY.max_tokens
    assert len(set(threads)) == 1 and loop_thread not in threads
