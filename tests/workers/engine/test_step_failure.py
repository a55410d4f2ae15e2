"""A failed model run leaves no wrong KV behind: the blocks its step registered (whose KV it
never wrote) are forgotten before anything can match or demote them, its requests start over, and
a failing demotion hook is a counted miss, never a failed step. (Whom a failed run fails is
`test_forward_faults`'s subject.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cachesvc.kv.config import TierConfig
from cachesvc.kv.events import BlockRemoved, BlockStored, Event
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.engine.load import measure_load as _measure
from workers.engine.outputs import RequestFailed, RequestOutput
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _tokens(32, 5)  # 8 full blocks
A, B, C = (PREFIX + _tokens(6, s) for s in (1, 2, 3))


class InjectedError(RuntimeError):
    pass


def _fail_next_steps(engine: Engine, num: int = 1) -> None:
    """Make the next `num` model runs raise out of the step, as an OOM or a kernel error would
    (after the scheduler registered the batch's blocks)."""
    execute = engine.runner.execute
    left = [num]

    def failing(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise InjectedError("injected step failure")
        return execute(*args, **kwargs)

    engine.runner.execute = failing  # type: ignore[method-assign]


def _hbm_balance(events: list[Event]) -> set[BlockHash]:
    """Device blocks the events say are held at the end."""
    held: set[BlockHash] = set()
    for e in events:
        if isinstance(e, BlockStored) and e.tier == "hbm":
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.tier == "hbm":
            held.difference_update(e.block_hashes)
    return held


def _check_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_failed_step_forgets_the_blocks_it_registered(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    engine = new_engine(tiny_llama_dir)
    _fail_next_steps(engine)
    [rid] = engine.add_request(A, GREEDY)
    assert engine.step() == []  # nothing fails yet: its requests run again
    events = engine.pool.events.drain()
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert len(stored) == len(A) // BS  # registered when scheduled...
    assert _hbm_balance(events) == set()  # ...and removed again when the step failed
    assert engine.pool.num_cached == 0
    engine.abort(rid)  # what AsyncEngine does with the streams
    _check_idle(engine)
    [out] = engine.generate([B], GREEDY)
    assert list(out.token_ids) == expected(B) and out.num_cached_tokens == 0
    _check_idle(engine)


def test_failed_step_requeues_its_requests(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    # B shares A's prefix blocks inside the failed step; A then goes away. B must recompute
    # them, not trust KV the failed step never wrote.
    engine = new_engine(tiny_llama_dir)
    _fail_next_steps(engine)
    rid_a, rid_b = engine.add_request(A, GREEDY)[0], engine.add_request(B, GREEDY)[0]
    assert engine.step() == []  # nothing fails yet: its requests run again
    engine.abort(rid_a)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.finished)
    assert [(o.request_id, list(o.token_ids)) for o in outs] == [(rid_b, expected(B))]
    _check_idle(engine)


def test_async_engine_serves_on_after_a_failed_step(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    engine = new_engine(tiny_llama_dir)
    _fail_next_steps(engine, 2)  # A, alone, fails twice: it fails (workers.engine.suspects)

    async def main() -> list[int]:
        aengine = AsyncEngine(engine)
        try:
            with pytest.raises(RequestFailed, match="InjectedError"):
                async for _ in aengine.generate(A, GREEDY):
                    pass
            outs = [out async for out in aengine.generate(C, GREEDY)]
            return list(outs[-1].token_ids)
        finally:
            await aengine.shutdown()

    assert asyncio.run(main()) == expected(C)
    _check_idle(engine)
    events = engine.pool.events.drain()
    assert any(isinstance(e, BlockRemoved) for e in events)
    # Only C's blocks (computed after the failure) are still announced as held.
    pool = engine.pool
    held = {pool.block_hash(BlockId(i)) for i in range(pool.num_blocks)} - {None}
    assert held and _hbm_balance(events) == held


def test_failed_step_blocks_never_reach_the_tiers(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    engine = new_engine(tiny_llama_dir, TierConfig(dram_mb=1, plan="fetch"))
    assert engine.tiering is not None
    _fail_next_steps(engine)
    [rid] = engine.add_request(A, GREEDY)
    assert engine.step() == []  # nothing fails yet: its requests run again
    registered = {
        h for e in engine.pool.events.drain() if isinstance(e, BlockStored) for h in e.block_hashes
    }
    engine.abort(rid)
    engine.pool.reset_cache()  # every cached device block is demoted
    assert not any(engine.tiering.manager.held_locally(h) for h in registered)
    [out] = engine.generate([B], GREEDY)
    assert list(out.token_ids) == expected(B) and out.num_cached_tokens == 0
    engine.tiering.manager.check_integrity()
    _check_idle(engine)
    engine.close()


def test_failing_demotion_is_a_counted_miss(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    monkeypatch: Any,
    new_engine: Callable[..., Engine],
) -> None:
    # 16 blocks hold one request at a time: every prompt evicts (and demotes) the last one's.
    engine = new_engine(tiny_llama_dir, TierConfig(dram_mb=1, plan="fetch"), num_blocks=16)
    assert engine.tiering is not None
    manager = engine.tiering.manager
    demote = manager.demote
    calls = [0]

    def flaky(block: Any, *rest: Any) -> bool:  # rest: the block's retention and owner
        calls[0] += 1
        if calls[0] % 2:
            raise OSError("tier write failed")
        return demote(block, *rest)

    monkeypatch.setattr(manager, "demote", flaky)
    prompts = [A, _tokens(40, 11), B, _tokens(40, 12), C, A]
    for prompt in prompts:
        [out] = engine.generate([prompt], GREEDY)
        assert list(out.token_ids) == expected(prompt)
    failures = engine.pool.num_evict_hook_failures
    assert failures == (calls[0] + 1) // 2 > 0
    assert _measure(engine).tiering["demote_failed"] == failures
    manager.check_integrity()
    _check_idle(engine)
    engine.close()
