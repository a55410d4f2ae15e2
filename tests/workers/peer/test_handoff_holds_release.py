"""A hand-off's hold let go (`HandoffHolds.release`) on a tiny engine: its request was aborted
or ended before a pull, or the router says the hand-off is over or will not happen. The pool's
free blocks are what they were before the hold, at the next boundary, or once a copy under way
ends; a released hold serves no more chunks, and only the prompt under its salt is let go."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from holds_support import NUM_FULL, ONE_TOKEN, handoff_prompt, hold, holds_engine

from workers.engine.engine import Engine
from workers.peer.holds import HandoffHolds
from workers.peer.stage import prompt_hashes


@pytest.fixture
def engine(tiny_llama_dir: Path) -> Engine:
    return holds_engine(tiny_llama_dir)


def test_a_released_hold_gives_its_blocks_back_at_the_next_boundary(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    free_before = engine.pool.num_free
    prompt = handoff_prompt(1)
    hold(engine, holds, prompt, "tenant-a")
    assert engine.pool.num_free == free_before - NUM_FULL  # pinned for a pull
    assert not holds.release(prompt, "tenant-b")  # another tenant's prompt: nothing
    assert not holds.release(prompt[:-1], "tenant-a")
    assert engine.pool.num_free == free_before - NUM_FULL
    assert holds.release(prompt, "tenant-a")
    hashes = prompt_hashes(engine, prompt, "tenant-a")
    assert holds.lease(hashes, 0, NUM_FULL, 8) is None  # a later pull pins the usual way
    holds.at_boundary(engine)
    assert engine.pool.num_free == free_before
    assert holds.counters()["peer_held_blocks"] == 0
    assert not holds.release(prompt, "tenant-a")  # once
    engine.pool.check_integrity()


def test_a_copy_under_way_keeps_a_released_hold_until_it_ends(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    free_before = engine.pool.num_free
    prompt = handoff_prompt(2)
    hold(engine, holds, prompt, None)
    leased = holds.lease(prompt_hashes(engine, prompt, None), 0, NUM_FULL, 4)
    assert leased is not None
    assert holds.release(prompt, None)
    holds.at_boundary(engine)
    assert engine.pool.num_free == free_before - NUM_FULL  # still being copied
    holds.give_back(leased, delivered=True)
    holds.at_boundary(engine)
    assert engine.pool.num_free == free_before
    engine.pool.check_integrity()


def test_a_hold_still_waiting_for_its_prompt_is_dropped_and_wakes_its_puller(
    engine: Engine,
) -> None:
    """Aborted before its prompt was computed: a pull waiting for the blocks stops waiting, and
    the blocks computed later are not pinned."""
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(3)
    hashes = prompt_hashes(engine, prompt, None)
    holds.expect(prompt, hashes, None)

    async def wait_then_release() -> None:
        waiting = asyncio.ensure_future(holds.wait_for(hashes, 0, NUM_FULL, 60.0))
        await asyncio.sleep(0)
        assert holds.release(prompt, None)
        await asyncio.wait_for(waiting, 10.0)

    asyncio.run(wait_then_release())
    engine.generate([prompt], ONE_TOKEN)
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert holds.counters()["peer_held_blocks"] == 0
