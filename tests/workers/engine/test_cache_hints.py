"""A request's explicit cache controls in the engine (`CacheHints`): retention keeps a prompt
through a flood that evicts an unretained one, a tenant over its budget is trimmed and told,
skip-read computes everything, skip-write caches nothing, and the tokens never change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cachesvc.kv.quotas import TenantQuota
from workers.config import EngineConfig
from workers.deltas import stream_delta
from workers.engine.engine import Engine
from workers.engine.outputs import RequestOutput
from workers.protocol import CacheHints, Usage
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
KEEP = CacheHints(retention_s=3600, tenant="alice", session_id="s1")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine(EngineConfig(model=str(path), block_size=BS, **kw))


def _usage(out: RequestOutput) -> Usage:
    usage = stream_delta(out, str(out.request_id), 1, {}, "w0").usage
    assert usage is not None
    return usage


def _flood(engine: Engine, count: int, seed: int = 100) -> None:
    """Distinct prompts (another tenant's), together several times the pool."""
    for i in range(count):
        engine.generate([_tokens(60, seed + i)], GREEDY, cache=CacheHints(tenant="bob"))


def test_a_retained_prompt_survives_a_flood_an_unretained_one_does_not(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir)
    kept, lost = _tokens(41, 1), _tokens(41, 2)
    [first] = engine.generate([kept], GREEDY, cache=KEEP)
    engine.generate([lost], GREEDY)
    assert _usage(first).retained_tokens == 40  # its 10 full blocks
    _flood(engine, 20)  # 20 x 60 tokens: about 5 pools
    [again_kept] = engine.generate([kept], GREEDY)
    [again_lost] = engine.generate([lost], GREEDY)
    assert _usage(again_kept).cache_read_tokens == 40
    assert _usage(again_lost).cache_read_tokens == 0
    assert again_kept.token_ids == first.token_ids
    engine.pool.check_integrity()


def test_closing_the_session_ends_the_retention(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    kept = _tokens(41, 1)
    engine.generate([kept], GREEDY, cache=KEEP)
    assert engine.cache_admin.close_session("alice", "other") == 0
    assert engine.cache_admin.close_session("alice", "s1") == 10
    assert engine.cache_admin.tenant_blocks()["hbm"]["alice"].retained == 0
    _flood(engine, 20)
    [again] = engine.generate([kept], GREEDY)
    assert _usage(again).cache_read_tokens == 0


def test_retention_past_the_tenants_budget_is_trimmed_and_reported(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)  # 64 blocks; alice may retain a quarter: 16
    engine.cache_admin.set_quotas({"alice": TenantQuota(share=1.0, retention_share=0.25)})
    [out] = engine.generate([_tokens(81, 3)], GREEDY, cache=KEEP)  # 20 full blocks
    usage = _usage(out)
    assert (usage.retained_tokens, usage.retention_trimmed_tokens) == (64, 16)
    # The head is kept: the prompt's first 16 blocks outlive a flood, the rest do not.
    _flood(engine, 20)
    [again] = engine.generate([_tokens(81, 3)], GREEDY)
    assert _usage(again).cache_read_tokens == 64
    engine.pool.check_integrity()


def test_retention_covers_only_its_span(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _tokens(41, 4)
    span = CacheHints(retention_s=300, retention_tokens=22, tenant="alice")
    [out] = engine.generate([prompt], GREEDY, cache=span)
    assert _usage(out).retained_tokens == 20  # the 5 full blocks within 22 tokens
    _flood(engine, 20)
    [again] = engine.generate([prompt], GREEDY)
    assert _usage(again).cache_read_tokens == 20


def test_skip_read_computes_all_and_skip_write_caches_nothing(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _tokens(33, 5)
    [plain] = engine.generate([prompt], GREEDY)
    [skipped] = engine.generate([prompt], GREEDY, cache=CacheHints(skip_read=True))
    usage = _usage(skipped)
    assert usage.cache_read_tokens == 0 and usage.cache_write_tokens == 0  # hashes taken
    assert skipped.token_ids == plain.token_ids

    fresh = _engine(tiny_llama_dir)
    [unwritten] = fresh.generate([prompt], GREEDY, cache=CacheHints(skip_write=True))
    assert _usage(unwritten).cache_write_tokens == 0
    assert fresh.pool.num_cached == 0
    [after] = fresh.generate([prompt], GREEDY)
    assert _usage(after).cache_read_tokens == 0 and after.token_ids == plain.token_ids
    fresh.pool.check_integrity()


def test_a_tenant_over_its_share_gives_up_its_own_blocks_first(tiny_llama_dir: Path) -> None:
    """Alice's working set (a quarter of the pool) survives bob's flood with both at half the
    pool; without quotas LRU evicts it."""

    def alice_hits(quotas: dict[str, TenantQuota]) -> int:
        engine = _engine(tiny_llama_dir)
        engine.cache_admin.set_quotas(quotas)
        alice = CacheHints(tenant="alice")
        prompts = [_tokens(17, 10 + i) for i in range(4)]  # 4 x 4 blocks = 16 of 64
        for p in prompts:
            engine.generate([p], GREEDY, cache=alice)
        _flood(engine, 12)
        hits = sum(
            _usage(engine.generate([p], GREEDY, cache=alice)[0]).cache_read_tokens for p in prompts
        )
        engine.pool.check_integrity()
        return hits

    half = TenantQuota(share=0.5)
    assert alice_hits({"alice": half, "bob": half}) == 64
    assert alice_hits({}) == 0
