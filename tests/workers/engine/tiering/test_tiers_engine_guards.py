"""The engine over tiers it cannot trust to be honest or to answer.

Signed blocks: with a tier key, a block forged in NVMe or Redis (its KV changed, its checksum
recomputed), a block written without the key or under another key is a counted miss, and the
greedy tokens equal the no-cache engine's. A frozen Redis (SIGSTOP): generation goes on with the
same tokens, the engine's thread never writes to Redis, and its reads cost at most
`redis_breaker_failures` short timeouts before the breaker skips Redis altogether.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from test_tiers_engine import (
    BS,
    GREEDY,
    A,
    B,
    C,
    _chain,
    check,
    make_engine,
    no_cache_tokens,
    run,
    run_then_evict,
)

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.breaker import OPEN
from cachesvc.kv.codec import FLAG_SIGNED, Codec
from cachesvc.kv.config import TierConfig
from cachesvc.kv.types import BlockHash
from workers.engine.engine import Engine


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> Callable[[list[int]], list[int]]:
    return no_cache_tokens(tiny_llama_dir)


def key_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")  # as docs/deploy.md makes one
    return str(path)


def forge(engine: Engine, tier: str, blob: bytes, block_hash: BlockHash) -> bytes:
    """Other KV under the block's header with its checksum recomputed: what whoever can write
    the tier can make, and what a checksum alone would serve."""
    assert engine.tiering is not None
    honest = engine.tiering.manager.codecs[tier].decode(blob, block_hash)
    assert honest is not None
    unkeyed = Codec(engine.loaded.fingerprint)
    forged = unkeyed.encode(block_hash, honest.parent, honest.dtype, np.full_like(honest.array, 3))
    assert unkeyed.decode(forged, block_hash) is not None
    return forged


def test_a_forged_nvme_block_is_refused_and_computed(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    folder = tmp_path / "nvme"
    key = key_file(tmp_path, "key")
    tiers = TierConfig(nvme_path=str(folder), nvme_mb=1, plan="fetch", tier_key_file=key)
    engine = make_engine(tiny_llama_dir, tiers)
    run_then_evict(engine, A)
    assert engine.tiering is not None
    nvme = engine.tiering.manager.tier("nvme")
    nvme.flush()  # type: ignore[attr-defined]
    files = {p.name.split("-")[0]: p for p in folder.iterdir()}
    chain = _chain(engine, A)
    forged = files[chain[8].hex()]
    forged.write_bytes(forge(engine, "nvme", forged.read_bytes(), chain[8]))
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage["nvme"] == 8 * BS  # block 8 refused: 8..11 computed
    assert nvme.stats.unverified == 1 and engine.tiering.metrics()["nvme_unverified"] == 1
    # A signed block whose KV changed, its MAC kept.
    tampered = files[chain[3].hex()]
    data = bytearray(tampered.read_bytes())
    data[-1] ^= 0x01
    tampered.write_bytes(bytes(data))
    engine.pool.reset_cache()
    tokens, usage = run(engine, C)
    assert tokens == expected(C) and usage["nvme"] == 3 * BS
    assert nvme.stats.unverified == 2
    check(engine)
    engine.close()


def test_a_forged_redis_entry_is_refused_and_deleted(
    tiny_llama_dir: Path, tmp_path: Path, fresh_redis_url: str, expected: Any
) -> None:
    key = key_file(tmp_path, "key")
    tiers = TierConfig(
        redis_url=fresh_redis_url, redis_min_reuse=0, plan="fetch", tier_key_file=key
    )
    engine = make_engine(tiny_llama_dir, tiers)
    run_then_evict(engine, A)
    assert engine.tiering is not None
    tier = engine.tiering.manager.tier("redis")
    tier.flush()  # type: ignore[attr-defined]
    client = redis.Redis.from_url(fresh_redis_url)
    block_hash = _chain(engine, A)[5]
    entry = tier.key(block_hash)  # type: ignore[attr-defined]
    client.set(entry, forge(engine, "redis", client.get(entry), block_hash))
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage["redis"] == 5 * BS
    assert tier.stats.unverified == 1 and engine.tiering.metrics()["redis_unverified"] == 1
    assert engine.tiering.manager.stats.failed == {"redis": 1}
    tier.flush()  # type: ignore[attr-defined]
    assert client.get(entry) is None  # deleted for every worker
    engine.close()


@pytest.mark.parametrize("kind", ["nvme", "redis"])
@pytest.mark.parametrize(
    ("writer", "reader", "found"),
    [("k1", "k1", 48), (None, "k1", 0), ("k1", "k2", 0), ("k1", None, 0)],
)
def test_blocks_are_read_back_only_under_the_key_that_signed_them(
    tiny_llama_dir: Path,
    tmp_path: Path,
    fresh_redis_url: str,
    expected: Any,
    kind: str,
    writer: str | None,
    reader: str | None,
    found: int,
) -> None:
    keys = {name: key_file(tmp_path, name) for name in ("k1", "k2")}

    def tiers(key: str | None) -> TierConfig:
        key_path = None if key is None else keys[key]
        if kind == "nvme":
            folder = str(tmp_path / "nvme")
            return TierConfig(nvme_path=folder, nvme_mb=1, plan="fetch", tier_key_file=key_path)
        return TierConfig(
            redis_url=fresh_redis_url, redis_min_reuse=0, plan="fetch", tier_key_file=key_path
        )

    first = make_engine(tiny_llama_dir, tiers(writer))
    run_then_evict(first, A)
    first.close()  # its NVMe folder or Redis entries stay for the next worker
    again = make_engine(tiny_llama_dir, tiers(reader))
    tokens, usage = run(again, B)
    assert tokens == expected(B) and usage.get(kind, 0) == found
    assert again.tiering is not None
    assert again.tiering.manager.tier(kind).stats.unverified == (0 if found else 1)
    again.close()


def test_dram_blocks_are_signed_on_their_way_to_nvme(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any
) -> None:
    blob = 2 * 2 * BS * 2 * 16 * 4 + 200  # a block of the tiny model, with room for its header
    folder = tmp_path / "nvme"
    tiers = TierConfig(
        dram_mb=5 * blob / 2**20,
        nvme_path=str(folder),
        nvme_mb=1,
        plan="fetch",
        tier_key_file=key_file(tmp_path, "key"),
    )
    engine = make_engine(tiny_llama_dir, tiers)
    assert run_then_evict(engine, A) == expected(A)
    tokens, usage = run(engine, B)
    assert tokens == expected(B)
    assert usage["dram"] > 0 and usage["nvme"] > 0 and usage["dram"] + usage["nvme"] == 48
    flags = {int.from_bytes(p.read_bytes()[6:8], "little") for p in folder.iterdir()}
    assert flags and all(f & FLAG_SIGNED for f in flags)
    check(engine)
    engine.close()


# ---- a frozen Redis ---------------------------------------------------------------------------


@contextmanager
def frozen(server: LocalRedis, limit_s: float = 120.0) -> Iterator[None]:
    """The server stopped for the block. A watchdog resumes it after `limit_s`, so a test that
    waits on it fails instead of hanging."""
    assert server.proc is not None
    pid = server.proc.pid
    thawed = threading.Event()

    def thaw() -> None:
        thawed.set()
        os.kill(pid, signal.SIGCONT)

    watchdog = threading.Timer(limit_s, thaw)
    os.kill(pid, signal.SIGSTOP)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
    assert not thawed.is_set(), f"the engine waited on the frozen Redis for {limit_s} s"


@dataclass(frozen=True)
class RedisCall:
    on_engine_thread: bool
    commands: frozenset[str]
    timeout_s: float | None
    failed: bool


def record_redis_calls(monkeypatch: pytest.MonkeyPatch) -> list[RedisCall]:
    """Every pipelined Redis call from now on: its thread, commands, timeout and outcome."""
    calls: list[RedisCall] = []
    execute = redis.client.Pipeline.execute

    def recorded(pipe: Any, raise_on_error: bool = True) -> Any:
        main = threading.current_thread() is threading.main_thread()
        commands = frozenset(str(args[0]).upper() for args, _ in pipe.command_stack)
        timeout = pipe.connection_pool.connection_kwargs.get("socket_timeout")
        try:
            out = execute(pipe, raise_on_error)
        except redis.RedisError:
            calls.append(RedisCall(main, commands, timeout, True))
            raise
        calls.append(RedisCall(main, commands, timeout, False))
        return out

    monkeypatch.setattr(redis.client.Pipeline, "execute", recorded)
    return calls


def test_a_frozen_redis_stalls_no_step(
    tiny_llama_dir: Path, own_redis: LocalRedis, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = 2
    tiers = TierConfig(
        redis_url=own_redis.url,
        redis_min_reuse=0,  # every evicted block is shared: writes on every eviction
        plan="fetch",
        redis_timeout_s=0.5,
        redis_read_timeout_s=0.05,
        redis_retry_s=3600,  # no probe during the test: the breaker stays open once open
        redis_breaker_failures=failures,
    )
    engine = make_engine(tiny_llama_dir, tiers)
    assert engine.tiering is not None
    tier = engine.tiering.manager.tier("redis")
    run_then_evict(engine, A)  # shared while Redis answers
    tier.flush()  # type: ignore[attr-defined]
    run(engine, C)  # C's last full block stays on the device, not shared yet
    tier.flush()  # type: ignore[attr-defined]
    calls = record_redis_calls(monkeypatch)
    with frozen(own_redis):
        engine.pool.reset_cache()  # its eviction shares it: a write for the frozen Redis ...
        tier.flush()  # type: ignore[attr-defined]  # ... that times out on the writer thread
        engine.add_request(B, GREEDY)
        engine.add_request(C, GREEDY)
        outs = []
        while engine.has_unfinished():
            outs.extend(o for o in engine.step() if o.finished)
        engine.pool.reset_cache()  # evictions: more shares into the frozen Redis
        later = [run(engine, p)[0] for p in (A, B)]
        engine.pool.reset_cache()
    by_id = {o.request_id: list(o.token_ids) for o in outs}
    assert sorted(by_id.values()) == sorted([expected(B), expected(C)])
    assert later == [expected(A), expected(B)]

    # The engine's thread only ever read, with the short timeout, and at most `failures` times
    # over all those requests (every call to a frozen Redis fails): then the breaker skipped it.
    engine_calls = [c for c in calls if c.on_engine_thread]
    assert all(c.commands <= {"EXISTS", "GET"} for c in engine_calls)
    assert all(c.timeout_s == 0.05 for c in engine_calls)
    assert len(engine_calls) <= failures
    assert any("SET" in c.commands and c.failed for c in calls)  # the writer's, off the path
    assert tier.breaker.state == OPEN  # type: ignore[attr-defined]
    metrics = engine.tiering.metrics()
    assert metrics["redis_breaker_open"] == 1 and metrics["redis_breaker_opens"] == 1
    assert metrics["redis_errors"] <= failures + 1  # + a write that was in flight as it opened
    assert metrics["redis_rejected"] > 0  # writes while open were refused, never waited for
    engine.close()
