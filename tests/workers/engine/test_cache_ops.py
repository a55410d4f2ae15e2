"""Cache operations of the engine and its actor: flush (device only, nothing demoted), purge
(every tier, Redis included), a graceful stop that leaves the device cache on NVMe for the next
start, scoring that waits for free blocks, and the bounded table of tenants' root hashes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from cachesvc.kv.block_pool import NoFreeBlocksError
from cachesvc.kv.config import TierConfig
from cachesvc.kv.events import BlockRemoved, Cleared
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.types import RequestId
from workers.config import EngineConfig
from workers.engine import kv_manager
from workers.engine.engine import Engine
from workers.engine.request import Request
from workers.engine.scoring import ScoreError
from workers.protocol import StreamError
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOB = 2 * 2 * BS * 2 * 16 * 4 + 200  # a block of the tiny model, with room for its header


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _tokens(32, 9)  # 8 full blocks
A, B, C = (PREFIX + _tokens(6, s) for s in (1, 2, 3))
OTHER = _tokens(30, 4)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    [out] = engine.generate([prompt], GREEDY)
    usage = {} if engine.tiering is None else engine.tiering.usage(out.request_id)
    return list(out.token_ids), {k: v for k, v in usage.items() if v}


def _check_idle(engine: Engine) -> None:
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    if engine.tiering is not None:
        engine.tiering.manager.check_integrity()


# ---- flush -------------------------------------------------------------------------------------


def test_flush_drops_device_blocks_without_demoting_them(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    engine = new_engine(tiny_llama_dir, TierConfig(dram_mb=1, plan="fetch"))
    assert engine.tiering is not None
    assert _run(engine, A)[0] == expected(A)
    cached = engine.pool.num_cached
    engine.pool.events.drain()
    assert engine.flush() == cached > 0
    events = engine.pool.events.drain()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert len(removed) == cached and all(e.tier == "hbm" for e in events)
    assert engine.tiering.manager.held_by_tier() == {} and engine.tiering.manager.stats.demoted == 0
    tokens, usage = _run(engine, B)
    assert tokens == expected(B) and usage == {}  # computed again, from no tier
    _check_idle(engine)
    engine.close()


def test_flush_drops_the_tiers_suffixes_of_flushed_device_blocks(
    tiny_llama_dir: Path,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    engine = new_engine(tiny_llama_dir, TierConfig(dram_mb=1, plan="fetch"))
    assert engine.tiering is not None
    _run(engine, A)
    pool = engine.pool
    # Evict (and demote) A's last three blocks only: freed tail first, they are the oldest.
    taken = pool.allocate(pool.num_free - pool.num_cached + 3)
    pool.free(taken)
    assert sum(len(v) for v in engine.tiering.manager.held_by_tier().values()) == 3
    engine.flush()
    # Their prefix left the device undemoted: nothing could reach them any more.
    assert engine.tiering.manager.held_by_tier() == {}
    assert _run(engine, B)[0] == expected(B)
    _check_idle(engine)
    engine.close()


# ---- purge -------------------------------------------------------------------------------------


def test_purge_drops_every_tier(
    tiny_llama_dir: Path,
    tmp_path: Path,
    fresh_redis_url: str,
    expected: Callable[[list[int]], list[int]],
    new_engine: Callable[..., Engine],
) -> None:
    nvme = tmp_path / "nvme"
    tiers = TierConfig(
        dram_mb=3 * BLOB / 2**20,
        nvme_path=str(nvme),
        nvme_mb=1,
        redis_url=fresh_redis_url,
        redis_min_reuse=0,
        plan="fetch",
    )
    engine = new_engine(tiny_llama_dir, tiers)
    assert engine.tiering is not None
    manager = engine.tiering.manager
    _run(engine, A)
    engine.pool.reset_cache()  # demoted: DRAM, then NVMe, and shared through Redis
    _run(engine, OTHER)  # cached on the device
    client = redis.Redis.from_url(fresh_redis_url)
    client.set(b"cachesvc:kv:another-model:00", b"kept")
    manager.tier("redis").flush()  # type: ignore[attr-defined]
    namespace = f"cachesvc:kv:{engine.loaded.fingerprint}:*"
    held = {name: len(hashes) for name, hashes in manager.held_by_tier().items()}
    num_hbm, num_redis = engine.pool.num_cached, len(client.keys(namespace))
    assert num_hbm > 0 and num_redis > 0 and held["dram"] == 3 and held["nvme"] > 0
    engine.pool.events.drain()
    counts = engine.purge()
    assert counts == {"hbm": num_hbm, "dram": 3, "nvme": held["nvme"], "redis": num_redis}
    cleared = {e.tier for e in engine.pool.events.drain() if isinstance(e, Cleared)}
    assert cleared == {"hbm", "dram", "nvme", "redis"}
    assert manager.held_by_tier() == {} and engine.pool.num_cached == 0
    manager.tier("nvme").flush()  # type: ignore[attr-defined]
    assert list(nvme.glob("*.kv")) == []
    assert client.keys(namespace) == [] and client.get(b"cachesvc:kv:another-model:00") == b"kept"
    tokens, usage = _run(engine, B)
    assert tokens == expected(B) and usage == {}
    _check_idle(engine)
    engine.close()


# ---- a graceful stop keeps the device cache on NVMe ---------------------------------------------


@pytest.mark.parametrize("dram_mb", [0, 1], ids=["nvme", "dram+nvme"])
def test_close_writes_the_device_cache_to_nvme_for_the_next_start(
    tiny_llama_dir: Path,
    tmp_path: Path,
    expected: Callable[[list[int]], list[int]],
    dram_mb: float,
    new_engine: Callable[..., Engine],
) -> None:
    tiers = TierConfig(dram_mb=dram_mb, nvme_path=str(tmp_path), nvme_mb=1, plan="fetch")
    first = new_engine(tiny_llama_dir, tiers)
    assert _run(first, A)[0] == expected(A)  # A's blocks stay on the device: nothing evicted
    first.close()
    again = new_engine(tiny_llama_dir, tiers)
    tokens, usage = _run(again, B)
    assert tokens == expected(B) and usage == {"nvme": len(PREFIX)}
    _check_idle(again)
    again.close()


# ---- scoring -----------------------------------------------------------------------------------


def test_score_without_enough_free_blocks_now_is_retryable(
    tiny_llama_dir: Path, new_engine: Callable[..., Engine]
) -> None:
    engine = new_engine(tiny_llama_dir, num_blocks=16)
    prefix, items = _tokens(8, 1), [_tokens(6, 2), _tokens(6, 3)]  # 6 blocks
    held = engine.pool.allocate(12)  # as running requests would
    with pytest.raises(NoFreeBlocksError, match="free"):
        engine.score(prefix, items, [1])
    engine.pool.free(held)
    assert len(engine.score(prefix, items, [1])) == 2
    with pytest.raises(ScoreError, match="items"):  # can never fit: a bad request
        engine.score(prefix, [_tokens(40, i) for i in range(4)], [1])
    _check_idle(engine)


def test_actor_flush_purge_and_score(
    tiny_llama_dir: Path, expected: Callable[[list[int]], list[int]]
) -> None:
    from workers.actor import WorkerActor

    config = EngineConfig(
        model=str(tiny_llama_dir),
        block_size=BS,
        num_blocks=32,
        tiers=TierConfig(dram_mb=1, plan="fetch"),
    )
    actor = WorkerActor("w0", config, max_queued_requests=8)
    engine = actor._engine.engine
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def generate(prompt: list[int], request_id: str) -> list[int]:
        out: list[int] = []
        async for delta in actor.generate(prompt, params, request_id, None):
            assert not isinstance(delta, StreamError)
            out.extend(delta.token_ids)
        return out

    async def main() -> None:
        assert await generate(A, "r0") == expected(A)
        num_cached = engine.pool.num_cached
        assert await actor.flush() == num_cached > 0
        assert engine.tiering is not None and engine.tiering.manager.held_by_tier() == {}
        assert await generate(A, "r1") == expected(A)
        # Evict A's last two blocks, into DRAM: the rest stays on the device.
        engine.pool.free(engine.pool.allocate(engine.pool.num_free - num_cached + 2))
        assert await actor.purge() == {"hbm": num_cached - 2, "dram": 2}
        held = engine.pool.allocate(engine.pool.num_free - 1)
        busy = await actor.score(A[:8], [A[8:14], B[8:14]], [1])
        assert isinstance(busy, StreamError) and busy.code == "resource_exhausted"
        engine.pool.free(held)
        scores = await actor.score(A[:8], [A[8:14], B[8:14]], [1])
        assert not isinstance(scores, StreamError) and len(scores) == 2
        never = await actor.score(A[:8], [_tokens(60, i) for i in range(3)], [1])
        assert isinstance(never, StreamError) and never.code == "invalid_argument"
        await actor.close()

    asyncio.run(main())
    _check_idle(engine)


# ---- tenants' root hashes ----------------------------------------------------------------------


def test_root_hashes_are_kept_for_a_bounded_number_of_salts(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    new_engine: Callable[..., Engine],
) -> None:
    monkeypatch.setattr(kv_manager, "MAX_ROOTS", 4)
    engine = new_engine(tiny_llama_dir)
    fingerprint = engine.loaded.fingerprint
    for i in range(10):
        salt = f"tenant-{i}"
        request = Request(RequestId(f"r{i}"), A, GREEDY, cache_salt=salt)
        want = hash_blocks(A, BS, root_hash(fingerprint, BS, salt))
        assert engine.kv.block_hashes(request) == want
        again = Request(RequestId("r"), A, GREEDY, cache_salt="tenant-0")
        engine.kv.block_hashes(again)  # the most recently used salt stays
    assert len(engine.kv._roots) == 4 and "tenant-0" in engine.kv._roots
