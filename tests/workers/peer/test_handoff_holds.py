"""A handed-off prompt's blocks held for its puller (`HandoffHolds`) on a tiny engine: pinned at
the first boundary at which all are computed, served in slices equal to what a boundary pin
would copy, given back once sent in full or too old, never while a copy is under way, and never
served to another prompt or another tenant."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from holds_support import NUM_FULL, ONE_TOKEN, handoff_prompt, hold, holds_engine

from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.peer.holds import HandoffHolds
from workers.peer.stage import copy_run, pin_run, prompt_hashes, unpin


@pytest.fixture
def engine(tiny_llama_dir: Path) -> Engine:
    return holds_engine(tiny_llama_dir)


def _room(engine: Engine, num_blocks: int) -> torch.Tensor:
    cache = engine.runner.kv_caches[0]
    from workers.peer.stage import block_shape

    return torch.empty((num_blocks, *block_shape(engine)), dtype=cache.dtype)


def test_pinned_once_computed_and_given_back_once_sent(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(1)
    hashes = prompt_hashes(engine, prompt, None)
    holds.expect(prompt, hashes, None)
    holds.at_boundary(engine)  # nothing computed yet: nothing to serve
    assert holds.lease(hashes, 0, NUM_FULL, 4) is None

    engine.generate([prompt], ONE_TOKEN)
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks - NUM_FULL  # pinned, not evictable
    first = holds.lease(hashes, 0, NUM_FULL, 4)
    second = holds.lease(hashes, 4, NUM_FULL, 4)
    assert first is not None and second is not None
    assert (first.start_block, first.num_blocks, second.start_block, second.num_blocks) == (
        0,
        4,
        4,
        2,
    )

    # What a slice copies is what a boundary pin of the same blocks copies.
    reference = pin_run(engine, prompt, None, 0, NUM_FULL, NUM_FULL)
    expected = copy_run(engine.runner.kv_caches, reference, _room(engine, NUM_FULL)).payload
    got = [copy_run(engine.runner.kv_caches, r, _room(engine, 4)).payload for r in (first, second)]
    assert np.array_equal(expected, np.concatenate(got))
    unpin(engine, reference)

    assert not holds.give_back(first, delivered=True)  # block 4 and 5 not sent yet
    assert holds.give_back(second, delivered=True)
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert holds.lease(hashes, 0, NUM_FULL, 4) is None  # gone: a later pull pins the usual way
    engine.pool.check_integrity()


def test_a_copy_under_way_keeps_an_expired_hold(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(2)
    hold(engine, holds, prompt)
    hashes = prompt_hashes(engine, prompt, None)
    leased = holds.lease(hashes, 0, NUM_FULL, NUM_FULL)
    assert leased is not None
    holds.ttl_s = 0.0  # too old from now on
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks - NUM_FULL  # still being copied
    holds.give_back(leased, delivered=False)  # the puller went away: not sent
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_never_served_to_another_prompt_or_tenant(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(3)
    hold(engine, holds, prompt, salt="tenant-a")
    assert holds.lease(prompt_hashes(engine, prompt, "tenant-b"), 0, NUM_FULL, 8) is None
    assert holds.lease(prompt_hashes(engine, prompt, None), 0, NUM_FULL, 8) is None
    other = prompt[:8] + [p + 1 for p in prompt[8:]]  # the first two blocks alike
    other_hashes = prompt_hashes(engine, other, "tenant-a")
    assert holds.lease(other_hashes, 2, NUM_FULL, 8) is None
    shared = holds.lease(other_hashes, 0, NUM_FULL, 8)
    # Only the shared leading blocks, as a boundary pin of the other prompt would find.
    assert shared is not None and shared.hashes == tuple(other_hashes[:2])


def test_holds_take_at_most_their_share_of_the_pool(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=60.0, max_blocks=NUM_FULL + 2)
    first, second = handoff_prompt(4), handoff_prompt(5)
    hold(engine, holds, first)
    hold(engine, holds, second)  # would take 12 blocks of 8: not held
    assert holds.lease(prompt_hashes(engine, first, None), 0, NUM_FULL, 8) is not None
    assert holds.lease(prompt_hashes(engine, second, None), 0, NUM_FULL, 8) is None
    assert holds.counters()["peer_held_blocks"] == NUM_FULL


def test_the_wait_for_the_prefill_is_not_counted_against_the_pins(engine: Engine) -> None:
    holds = HandoffHolds(ttl_s=0.0, max_blocks=32)  # pins go at the boundary after they came
    prompt = handoff_prompt(6)
    hashes = prompt_hashes(engine, prompt, None)
    holds.expect(prompt, hashes, None)
    holds.at_boundary(engine)  # queued behind other prompts: still waiting, not expired
    engine.generate([prompt], ONE_TOKEN)
    holds.at_boundary(engine)
    assert holds.lease(hashes, 0, NUM_FULL, 8) is not None


def test_blocks_are_held_as_a_chunked_prefill_computes_them(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), block_size=4, num_blocks=64, max_num_batched_tokens=8
    )
    engine = Engine(config)  # two blocks a step
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(7)
    hashes = prompt_hashes(engine, prompt, None)
    holds.expect(prompt, hashes, None)
    holds.expect(prompt, hashes, None)  # asked again (the puller came first): held once
    engine.add_request(prompt, ONE_TOKEN)
    engine.step()
    holds.at_boundary(engine)
    early = holds.lease(hashes, 0, NUM_FULL, 8)
    assert early is not None and (early.start_block, early.num_blocks) == (0, 2)
    assert holds.lease(hashes, 2, NUM_FULL, 8) is None  # not computed yet
    assert holds.counters()["peer_held_early_chunks"] == 1
    while engine.has_unfinished():
        engine.step()
        holds.at_boundary(engine)
    rest = holds.lease(hashes, 1, NUM_FULL, 8)  # one run now, across the boundaries' pins
    assert rest is not None and (rest.start_block, rest.num_blocks) == (1, NUM_FULL - 1)
    assert holds.counters()["peer_held_early_chunks"] == 1

    reference = pin_run(engine, prompt, None, 0, NUM_FULL, NUM_FULL)
    expected = copy_run(engine.runner.kv_caches, reference, _room(engine, NUM_FULL)).payload
    got = [copy_run(engine.runner.kv_caches, r, _room(engine, 8)).payload for r in (early, rest)]
    assert np.array_equal(expected[:2], got[0]) and np.array_equal(expected[1:], got[1])
    unpin(engine, reference)

    assert not holds.give_back(early, delivered=True)
    assert holds.give_back(rest, delivered=True)
    holds.at_boundary(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_a_pull_waits_for_blocks_still_being_computed(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), block_size=4, num_blocks=64, max_num_batched_tokens=8
    )
    engine = Engine(config)
    holds = HandoffHolds(ttl_s=60.0, max_blocks=32)
    prompt = handoff_prompt(8)
    hashes = prompt_hashes(engine, prompt, None)

    async def scenario() -> list[int]:
        await holds.wait_for(hashes, 0, 4, timeout_s=5.0)  # nobody computes it: no wait
        holds.expect(prompt, hashes, None)
        engine.add_request(prompt, ONE_TOKEN)
        await holds.wait_for(hashes, 0, 4, timeout_s=0.05)  # nothing computed: times out
        seen: list[int] = []

        def step() -> None:  # a step and its boundary, as the actor's loop runs them
            engine.step()
            holds.at_boundary(engine)
            seen.append(sum(r.num_blocks for h in holds._holds for r in h.runs))
            if engine.has_unfinished():
                asyncio.get_running_loop().call_later(0.01, step)

        asyncio.get_running_loop().call_later(0.01, step)
        await holds.wait_for(hashes, 0, 4, timeout_s=30.0)
        return seen

    seen = asyncio.run(scenario())
    assert seen[-1] >= 4 and all(n < 4 for n in seen[:-1])  # woken by the boundary that had them
