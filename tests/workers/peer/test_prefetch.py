"""A handed-off prompt prefetched from its holder (`Prefetcher`), between two engines in one
process: the blocks land in the pool as cached blocks, a request of that prompt then finds them
there (the same greedy tokens, nothing computed but the tail) and counts them as pulled once; a
pool without room left for its running requests takes none; a holder that fails leaves the
request to pull or compute, and one that stops answering is not waited for."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from test_peer_blocks import BS, HOLDER, NUM_FULL, PROMPT, _engine, _puller, _run

from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.model.loader import LoadedModel, load_model
from workers.peer import prefetch as prefetch_module
from workers.peer.prefetch import Prefetcher, PrefetchResult


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32, device="cpu")


def _prefetch(puller: Engine, salt: str) -> tuple[PrefetchResult, int, int]:
    """Prefetch PROMPT from the holder; the result, and the tokens the request that follows
    counts as pulled (asked twice: the second gets none)."""

    async def go() -> tuple[PrefetchResult, int, int]:
        engine = AsyncEngine(puller)
        prefetcher = Prefetcher(engine)
        try:
            result = await prefetcher.prefetch(HOLDER.name, PROMPT, salt, NUM_FULL, 30.0)
            follows = PROMPT + [5]  # the prompt and its first token, as the hand-off sends it
            first = await prefetcher.settled(follows, salt, NUM_FULL, 1.0)
            again = await prefetcher.settled(follows, salt, NUM_FULL, 1.0)
            return result, first, again
        finally:
            prefetcher.close()
            await engine.shutdown()

    return asyncio.run(go())


def test_prefetched_blocks_are_found_by_the_request(loaded: LoadedModel) -> None:
    reference, _, _ = _run(_engine(loaded, enable_prefix_caching=False), PROMPT)
    holder = _engine(loaded)
    _run(holder, PROMPT, "t1")
    puller, link = _puller(loaded, holder)
    result, counted, again = _prefetch(puller, "t1")
    assert result == PrefetchResult(NUM_FULL, 0, None)
    assert (counted, again) == (NUM_FULL * BS, 0)
    assert puller.pool.num_free == puller.pool.num_blocks  # cached, held by no request
    tokens, cached, by_tier = _run(puller, PROMPT, "t1")
    assert tokens == reference
    assert cached == NUM_FULL * BS and by_tier == {"hbm": NUM_FULL * BS}
    puller.pool.check_integrity()
    # Another tenant's prompt is not served from them.
    _, cached, _ = _run(puller, PROMPT, "t2")
    assert cached == 0


def test_no_room_for_the_running_requests_lands_nothing(loaded: LoadedModel) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT, "t1")
    puller, _ = _puller(loaded, holder)
    taken = puller.pool.allocate(puller.pool.num_blocks - 12)  # as running requests would
    result, counted, _ = _prefetch(puller, "t1")
    assert result.landed_blocks == 0 and result.stopped == "no room in the pool"
    assert counted == 0
    puller.pool.free(taken)
    puller.pool.check_integrity()


def test_a_failing_holder_stops_the_prefetch(loaded: LoadedModel) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT, "t1")
    puller, link = _puller(loaded, holder)
    link.fail_from = 0
    result, counted, _ = _prefetch(puller, "t1")
    assert result.landed_blocks == 0 and result.stopped is not None
    assert "holder did not answer" in result.stopped and counted == 0
    assert puller.pool.num_free == puller.pool.num_blocks


def test_a_stalled_prefetch_is_not_waited_for(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetch_module, "STALL_S", 0.1)
    holder = _engine(loaded)
    _run(holder, PROMPT, "t1")
    puller, link = _puller(loaded, holder)
    link.gate = threading.Event()  # the holder answers nothing (frozen) until it is set

    async def go() -> tuple[int, PrefetchResult, int]:
        engine = AsyncEngine(puller)
        prefetcher = Prefetcher(engine)
        try:
            running = asyncio.ensure_future(
                prefetcher.prefetch(HOLDER.name, PROMPT, "t1", NUM_FULL, 30.0)
            )
            await asyncio.sleep(0.05)
            # Given up after STALL_S without a chunk, long before the holder would answer (a
            # wait until the 30 s timeout fails here).
            waiting = prefetcher.settled(PROMPT + [5], "t1", NUM_FULL, 30.0)
            counted = await asyncio.wait_for(waiting, timeout=10.0)
            assert link.gate is not None
            link.gate.set()  # it thaws: the prefetch ends, its blocks no request's pull
            result = await running
            later = await prefetcher.settled(PROMPT + [5], "t1", NUM_FULL, 1.0)
            return counted, result, later
        finally:
            prefetcher.close()
            await engine.shutdown()

    counted, result, later = asyncio.run(go())
    assert counted == 0 and later == 0
    assert result.landed_blocks == NUM_FULL
