"""The engine over DRAM / NVMe / Redis tiers: greedy tokens equal the no-cache engine's whatever
the tier, the mix of tiers or the plan (fetch, Cake split, recompute); faults (corrupt or
truncated files, garbage in Redis, Redis killed and restarted, a full disk) are counted misses
with the same tokens; a restarted worker and another process find the blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from suite_support import require_redis_server

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.config import TierConfig
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.planner import ComputeCost
from cachesvc.kv.types import BlockHash
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _tokens(48, 7)  # 12 full blocks
A, B, C = (PREFIX + _tokens(5, s) for s in (1, 2, 3))


def no_cache_tokens(model_dir: Path) -> Callable[[list[int]], list[int]]:
    """Greedy tokens of the engine with no prefix cache at all, per prompt (each computed once)."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir), block_size=BS, num_blocks=256, enable_prefix_caching=False
        )
    )
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            [out] = engine.generate([prompt], GREEDY)
            cache[tuple(prompt)] = list(out.token_ids)
        return cache[tuple(prompt)]

    return get


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> Callable[[list[int]], list[int]]:
    return no_cache_tokens(tiny_llama_dir)


def make_engine(path: Path, tiers: TierConfig, num_blocks: int = 24) -> Engine:
    return Engine(EngineConfig(model=str(path), block_size=BS, num_blocks=num_blocks, tiers=tiers))


def run(engine: Engine, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """Greedy tokens of one prompt, and where its prompt tokens came from."""
    [out] = engine.generate([prompt], GREEDY)
    assert engine.tiering is not None
    usage = engine.tiering.usage(out.request_id)
    # The request's own output reports the same split by tier.
    assert dict(out.cached_tokens_by_tier) == {k: v for k, v in usage.items() if v}
    assert sum(out.cached_tokens_by_tier.values()) == out.num_cached_tokens
    return list(out.token_ids), usage


def run_then_evict(engine: Engine, prompt: list[int]) -> list[int]:
    tokens, _ = run(engine, prompt)
    engine.pool.reset_cache()  # every cached device block leaves: demoted into the tiers
    return tokens


def check(engine: Engine) -> None:
    assert engine.tiering is not None
    engine.tiering.manager.check_integrity()
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def tier_config(kind: str, tmp_path: Path, redis_url: str | None, **kw: Any) -> TierConfig:
    if kind == "dram":
        return TierConfig(dram_mb=1, **kw)
    if kind == "nvme":
        return TierConfig(nvme_path=str(tmp_path / "nvme"), nvme_mb=1, **kw)
    return TierConfig(redis_url=redis_url, redis_min_reuse=0, **kw)


@pytest.mark.parametrize("mode", ["fetch", "split", "auto"])
@pytest.mark.parametrize("kind", ["dram", "nvme", "redis"])
def test_prefix_from_each_tier_matches_no_cache(
    tiny_llama_dir: Path, tmp_path: Path, fresh_redis_url: str, expected: Any, kind: str, mode: str
) -> None:
    engine = make_engine(tiny_llama_dir, tier_config(kind, tmp_path, fresh_redis_url, plan=mode))
    assert run_then_evict(engine, A) == expected(A)
    tokens, usage = run(engine, B)
    assert tokens == expected(B)
    assert engine.tiering is not None and engine.tiering.last_plan is not None
    if mode == "fetch":
        assert engine.tiering.last_plan.kind == "fetch" and usage[kind] == 48
    if mode == "split":  # the front is recomputed while the back is fetched
        assert engine.tiering.last_plan.kind == "split" and 0 < usage[kind] < 48
    # B's plan (A found nothing to plan) was timed to the end of its prompt, for the metrics.
    plan, metrics = engine.tiering.last_plan.kind, engine.tiering.metrics()
    assert metrics[f"plan_{plan}_timed"] == 1
    assert metrics[f"plan_{plan}_predicted_s"] > 0 and metrics[f"plan_{plan}_actual_s"] > 0
    check(engine)
    engine.close()


def test_prefix_split_over_dram_and_nvme(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    blob = 2 * 2 * BS * 2 * 16 * 4 + 200  # a block of the tiny model, with room for its header
    tiers = TierConfig(dram_mb=5 * blob / 2**20, nvme_path=str(tmp_path), nvme_mb=1, plan="fetch")
    engine = make_engine(tiny_llama_dir, tiers)
    assert run_then_evict(engine, A) == expected(A)
    tokens, usage = run(engine, B)
    assert tokens == expected(B)
    assert usage["dram"] > 0 and usage["nvme"] > 0 and usage["dram"] + usage["nvme"] == 48
    check(engine)
    engine.close()


def test_tiny_device_pool_churns_through_the_tiers(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    # 18 blocks hold one request (14 blocks) at a time: each prompt evicts the previous ones.
    # plan="fetch": the tiny model recomputes so fast that the planner would often skip loads.
    tiers = TierConfig(dram_mb=0.02, nvme_path=str(tmp_path), nvme_mb=1, plan="fetch")
    engine = make_engine(tiny_llama_dir, tiers, num_blocks=18)
    others = [_tokens(50, s) for s in (11, 12)]
    prompts = [A, *others, B, C, others[0], A, others[1], B]
    outs = engine.generate(prompts, GREEDY)  # all queued at once: preemptions too
    assert [list(o.token_ids) for o in outs] == [expected(p) for p in prompts]
    for p in prompts:
        assert run(engine, p)[0] == expected(p)
    assert engine.tiering is not None and engine.tiering.stats.loaded_blocks > 0
    assert engine.tiering.manager.stats.demoted > 0
    check(engine)
    engine.close()


def test_restarted_worker_finds_its_nvme_blocks(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    tiers = TierConfig(nvme_path=str(tmp_path), nvme_mb=1, plan="fetch")
    first = make_engine(tiny_llama_dir, tiers)
    run_then_evict(first, A)
    first.close()
    again = make_engine(tiny_llama_dir, tiers)
    tokens, usage = run(again, B)
    assert tokens == expected(B) and usage["nvme"] == 48
    again.close()


def test_caps_move_the_plan_fetch_split_recompute(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    kinds = []
    for cap in (1e5, 0.1, 1e-4):  # MB/s: a fast disk, a slow one, one slower than anything
        tiers = TierConfig(nvme_path=str(tmp_path / str(cap)), nvme_mb=1, nvme_cap_mbps=cap)
        engine = make_engine(tiny_llama_dir, tiers)
        run_then_evict(engine, A)
        assert engine.tiering is not None
        # The tiny model computes a token in microseconds: give the planner the compute cost
        # of a big model (1 ms per token), so that the caps, not the model, decide.
        engine.tiering.costs.compute = ComputeCost(alpha_s=1e-3, beta_s=1e-3, gamma_s=0.0)
        tokens, usage = run(engine, B)
        assert tokens == expected(B)
        assert engine.tiering.last_plan is not None
        kinds.append(engine.tiering.last_plan.kind)
        engine.close()
    assert kinds == ["fetch", "split", "recompute"]


def test_corrupt_and_truncated_files_are_counted_misses(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    engine = make_engine(
        tiny_llama_dir, TierConfig(nvme_path=str(tmp_path), nvme_mb=1, plan="fetch")
    )
    run_then_evict(engine, A)
    assert engine.tiering is not None
    engine.tiering.manager.tier("nvme").flush()  # type: ignore[attr-defined]
    names = {p.name.split("-")[0]: p for p in tmp_path.iterdir()}
    chain = _chain(engine, A)
    flipped = names[chain[8].hex()]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x04
    flipped.write_bytes(bytes(data))
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage["nvme"] == 8 * BS
    assert engine.tiering.stats.failed_blocks == 4  # block 8 failed: 8..11 computed
    assert engine.tiering.metrics()["failed_blocks"] == 4
    truncated = names[chain[3].hex()]
    truncated.write_bytes(truncated.read_bytes()[:-10])
    engine.pool.reset_cache()
    tokens, usage = run(engine, C)
    assert tokens == expected(C) and usage["nvme"] == 3 * BS
    assert engine.tiering.manager.stats.failed == {"nvme": 2}
    check(engine)
    engine.close()


def _chain(engine: Engine, prompt: list[int]) -> list[BlockHash]:
    return hash_blocks(prompt, BS, root_hash(engine.loaded.fingerprint, BS))


def test_disk_full_never_fails_the_worker(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    # A budget of three blocks: the rest of the prefix is refused, not an error.
    tiers = TierConfig(nvme_path=str(tmp_path), nvme_mb=3 * 1200 / 2**20, plan="fetch")
    engine = make_engine(tiny_llama_dir, tiers)
    run_then_evict(engine, A)
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage.get("nvme", 0) <= 3 * BS
    check(engine)
    engine.close()


def test_failed_writes_stop_admission(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Faked ENOSPC: root ignores read-only bits and cannot mount a small disk here.
    engine = make_engine(tiny_llama_dir, TierConfig(nvme_path=str(tmp_path), nvme_mb=1))

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    run_then_evict(engine, A)
    assert engine.tiering is not None
    nvme = engine.tiering.manager.tier("nvme")
    nvme.flush()  # type: ignore[attr-defined]
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage.get("nvme", 0) == 0
    assert nvme.stats.errors > 0 and not nvme.admitting  # type: ignore[attr-defined]
    check(engine)
    engine.close()


def test_redis_admits_only_reused_blocks(
    tiny_llama_dir: Path, fresh_redis_url: str, expected: Any
) -> None:
    engine = make_engine(tiny_llama_dir, TierConfig(redis_url=fresh_redis_url, redis_min_reuse=2))
    client = redis.Redis.from_url(fresh_redis_url)
    assert engine.tiering is not None
    for n in range(3):
        assert run(engine, A)[0] == expected(A)
        engine.tiering.manager.tier("redis").flush()  # type: ignore[attr-defined]
        assert (len(client.keys("cachesvc:kv:*")) > 0) == (n == 2)  # third run: second reuse
    engine.close()


def test_garbage_under_a_redis_key_is_a_miss(
    tiny_llama_dir: Path, fresh_redis_url: str, expected: Any
) -> None:
    engine = make_engine(
        tiny_llama_dir, TierConfig(redis_url=fresh_redis_url, redis_min_reuse=0, plan="fetch")
    )
    run_then_evict(engine, A)
    assert engine.tiering is not None
    tier = engine.tiering.manager.tier("redis")
    tier.flush()  # type: ignore[attr-defined]
    key = tier.key(_chain(engine, A)[5])  # type: ignore[attr-defined]
    redis.Redis.from_url(fresh_redis_url).set(key, b"\x00garbage")
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage["redis"] == 5 * BS
    assert engine.tiering.manager.stats.failed == {"redis": 1}
    engine.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of our own, with a password, that a test may kill and restart."""
    require_redis_server()
    server = LocalRedis(tmp_path, password=uuid.uuid4().hex).start()
    yield server
    server.stop()


def test_redis_killed_mid_run_and_restarted(
    tiny_llama_dir: Path, own_redis: LocalRedis, expected: Any
) -> None:
    tiers = TierConfig(
        redis_url=own_redis.url,
        redis_password=own_redis.password,
        redis_min_reuse=0,
        plan="fetch",
        redis_timeout_s=0.2,
        redis_retry_s=0.2,
    )
    engine = make_engine(tiny_llama_dir, tiers)
    run_then_evict(engine, A)
    engine.add_request(B, GREEDY)
    own_redis.stop(kill=True)  # killed with a request in flight
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.finished)
    assert [list(o.token_ids) for o in outs] == [expected(B)]
    assert engine.tiering is not None
    redis_tier = engine.tiering.manager.tier("redis")
    assert redis_tier.stats.errors >= 1
    own_redis.start()  # empty: it kept nothing
    # Shared again, now that Redis is back. A call right after the restart may still time out
    # (0.2 s, on a busy machine) and lose its writes or miss: allowed, as long as a few tries on
    # Redis store C's blocks and serve the shared prefix to A.
    server = redis.Redis.from_url(own_redis.url, password=own_redis.password)
    keys = [redis_tier.key(h) for h in _chain(engine, C)]  # type: ignore[attr-defined]
    fetched = []
    for _ in range(10):
        time.sleep(0.3)  # the tier's retry window
        engine.pool.reset_cache()
        assert run_then_evict(engine, C) == expected(C)
        redis_tier.flush()  # type: ignore[attr-defined]
        if server.exists(*keys) != len(keys):
            continue
        tokens, usage = run(engine, A)
        assert tokens == expected(A)
        fetched.append(usage["redis"])
        if usage["redis"]:
            break
    assert fetched and fetched[-1] == 48
    engine.close()


_ENGINE_B = """
import json, sys
from workers.config import EngineConfig
from cachesvc.kv.config import TierConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams
path, url, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = Engine(EngineConfig(model=path, block_size=4, num_blocks=24,
                             tiers=TierConfig(redis_url=url, plan="fetch")))
[out] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(json.dumps({"tokens": list(out.token_ids), "usage": engine.tiering.usage(out.request_id)}))
"""


def test_block_computed_by_engine_a_is_fetched_by_engine_b_in_another_process(
    tiny_llama_dir: Path, fresh_redis_url: str, expected: Any
) -> None:
    engine_a = make_engine(
        tiny_llama_dir, TierConfig(dram_mb=1, redis_url=fresh_redis_url, redis_min_reuse=1)
    )
    run(engine_a, A)
    run(engine_a, A)  # one reuse: the prefix is now worth sharing
    engine_a.close()
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_B, str(tiny_llama_dir), fresh_redis_url, json.dumps(B)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected(B)
    assert result["usage"]["redis"] == 48


@pytest.mark.slow
def test_smollm2_prefix_split_over_dram_and_nvme_matches_no_cache(tmp_path: Path) -> None:
    from workers.model.loader import load_model

    loaded = load_model(None)
    text = "Once upon a time, in a small village at the edge of a great forest, there lived " * 8
    plain = Engine(EngineConfig(num_blocks=64, enable_prefix_caching=False), loaded)
    prefix = plain.encode_prompt(text)
    first, second = prefix + [13, 50], prefix + [30, 198, 4]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [list(o.token_ids) for o in plain.generate([first, second], params)]
    # 3 MB of DRAM holds 4 SmolLM2 blocks: the rest of the prefix goes on to NVMe.
    tiers = TierConfig(dram_mb=3, nvme_path=str(tmp_path), nvme_mb=64, plan="split")
    engine = Engine(EngineConfig(num_blocks=64, tiers=tiers), loaded)
    [out] = engine.generate([first], params)
    engine.pool.reset_cache()
    [again] = engine.generate([second], params)
    assert [list(out.token_ids), list(again.token_ids)] == want
    assert engine.tiering is not None and engine.tiering.last_plan is not None
    assert engine.tiering.last_plan.kind == "split"
    usage = engine.tiering.usage(again.request_id)
    assert usage.get("dram", 0) + usage.get("nvme", 0) > 0
    engine.close()
