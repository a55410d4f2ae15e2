"""Cache writes in a request's usage: the full prompt blocks it registered first in the device
pool. With the tokens read from the cache and the uncached rest they add up to the prompt, on
every path (cold, warm, in-batch sharing, preemption, n samples, lower tiers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cachesvc.kv.config import TierConfig
from workers.config import EngineConfig
from workers.deltas import stream_delta
from workers.engine.engine import Engine
from workers.engine.outputs import RequestOutput
from workers.protocol import Usage
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("num_blocks", 256)
    return Engine(EngineConfig(model=str(path), block_size=BS, **kw))


def _usage(out: RequestOutput) -> Usage:
    """The usage a worker reports for `out` (as its actor builds it)."""
    usage = stream_delta(out, str(out.request_id), 1, {}, "w0").usage
    assert usage is not None
    assert usage.uncached_tokens >= 0, usage
    assert usage.cache_read_tokens + usage.cache_write_tokens + usage.uncached_tokens == len(
        out.prompt_token_ids
    )
    return usage


def _split(out: RequestOutput) -> tuple[int, int, int]:
    u = _usage(out)
    return u.cache_read_tokens, u.cache_write_tokens, u.uncached_tokens


@pytest.mark.parametrize(
    ("length", "cold", "warm"),
    [
        # 17 tokens: 4 full blocks written, the partial fifth never; then all 4 read.
        (17, (0, 16, 1), (16, 0, 1)),
        # 16 tokens: the last block holds the token whose logits are sampled, so a warm
        # request recomputes it, and cannot register it again (its hash is taken).
        (16, (0, 16, 0), (12, 0, 4)),
        (3, (0, 0, 3), (0, 0, 3)),  # no full block: nothing cached either way
    ],
)
def test_cold_then_warm_split(
    tiny_llama_dir: Path, length: int, cold: tuple[int, ...], warm: tuple[int, ...]
) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _tokens(length, length)
    [first] = engine.generate([prompt], GREEDY)
    [second] = engine.generate([prompt], GREEDY)
    assert (_split(first), _split(second)) == (cold, warm)


def test_a_shared_prefix_is_written_once_then_read(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prefix = _tokens(20, 1)
    a, b = prefix + _tokens(9, 2), prefix + _tokens(9, 3)
    [out_a] = engine.generate([a], GREEDY)
    [out_b] = engine.generate([b], GREEDY)
    assert _split(out_a) == (0, 28, 1)
    assert _split(out_b) == (20, 8, 1)  # the prefix read, its own two full blocks written


def test_in_batch_duplicates_write_once(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _tokens(21, 4)
    outs = engine.generate([prompt, prompt, prompt], GREEDY)
    splits = [_split(o) for o in outs]
    # One of them wrote the 5 full blocks; the others shared them in the same step (read).
    assert sum(w for _, w, _ in splits) == 20
    assert sorted(splits) == [(0, 20, 1), (20, 0, 1), (20, 0, 1)]


def test_no_prefix_cache_writes_nothing(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, enable_prefix_caching=False)
    prompt = _tokens(18, 5)
    outs = engine.generate([prompt, prompt], GREEDY)
    assert [_split(o) for o in outs] == [(0, 0, 18), (0, 0, 18)]


def test_split_adds_up_under_preemption_and_samples(tiny_llama_dir: Path) -> None:
    # 30 blocks of 4 tokens cannot hold these requests at once: some are preempted and
    # recomputed, and their writes are still counted once.
    engine = _engine(tiny_llama_dir, num_blocks=30)
    prefix = _tokens(12, 6)
    prompts = [prefix + _tokens(n, 10 + n) for n in (5, 17, 26, 9, 31, 2)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    outs = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    usages = [_usage(out) for out in outs]  # each adds up
    assert any(u.cache_write_tokens for u in usages)
    assert any(u.cache_read_tokens for u in usages)


def test_blocks_read_from_a_tier_are_not_writes(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_blocks=24, tiers=TierConfig(dram_mb=1, plan="fetch"))
    prompt = _tokens(33, 7)
    [cold] = engine.generate([prompt], GREEDY)
    engine.pool.reset_cache()  # every cached device block leaves: demoted into DRAM
    [warm] = engine.generate([prompt], GREEDY)
    assert _split(cold) == (0, 32, 1)
    assert _usage(warm).cached_tokens == {"dram": 32}
    assert _split(warm) == (32, 0, 1)
    engine.close()
