"""Lossy KV in the tier manager: a lossy block (read from a quantized tier, or marked by the
engine) is stored only under a quantized codec — demoted, pushed down a tier, spilled or shared —
and is otherwise dropped, never written where it would read back as exact KV. And the blocks
already shared are forgotten only when the shared Redis restarted, not when a read failed."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.codec import Codec, KVBlock
from cachesvc.kv.events import EventLog
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.tiers.base import Tier
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier
from cachesvc.kv.tiers.redis_tier import RedisTier
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash

FP = "cd" * 16
SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, kv heads, head dim: quantizable
CHAIN = hash_blocks(list(range(16)), 2, root_hash(FP, 2))


def block(i: int, lossy: bool = False) -> KVBlock:
    array = np.random.default_rng(i).standard_normal(SHAPE).astype(np.float32)
    return KVBlock(CHAIN[i], CHAIN[i - 1] if i else None, "float32", array, lossy)


def blob_bytes(mode: str) -> int:
    return Codec(FP, mode).max_blob_size("float32", SHAPE)


def manager(
    tmp: Path,
    dram: str,
    nvme: str,
    dram_blocks: int = 8,
    shared: Tier | None = None,
    redis: str = "raw",
    device: set[BlockHash] | None = None,
) -> TierManager:
    """DRAM of `dram_blocks` blocks in codec `dram`, then NVMe in codec `nvme`, and `shared`
    in codec `redis`; `device`: the hashes the device pool holds."""
    slot = max(blob_bytes("raw"), blob_bytes(dram))
    tiers: list[Tier] = [
        DramTier(capacity_mb=dram_blocks * slot / 2**20, slot_bytes=slot),
        NvmeTier(tmp, capacity_mb=1),
    ]
    codecs = {"dram": Codec(FP, dram), "nvme": Codec(FP, nvme), "redis": Codec(FP, redis)}
    on_device = device if device is not None else set()
    return TierManager(
        tiers, shared, codecs, EventLog(), min_reuse=1, device_has=on_device.__contains__
    )


def held(m: TierManager, i: int) -> list[str]:
    return sorted(m.held_locally(CHAIN[i]))


def test_a_lossy_block_skips_lossless_tiers_for_a_quantized_one(tmp_path: Path) -> None:
    m = manager(tmp_path, dram="raw", nvme="int8")
    assert m.demote(block(0))  # exact KV: the first tier takes it
    assert m.demote(block(1, lossy=True))  # lossy: not raw DRAM, but int8 NVMe
    assert held(m, 0) == ["dram"] and held(m, 1) == ["nvme"]
    assert m.stats.lossy_refused == 1
    result = m.read([("nvme", [CHAIN[1]])])
    assert len(result.blocks) == 1 and result.blocks[0].lossy  # and it reads back lossy
    m.check_integrity()
    m.close()


def test_a_lossy_block_no_tier_may_keep_is_dropped_with_its_suffix(tmp_path: Path) -> None:
    device = {CHAIN[0]}
    m = manager(tmp_path, dram="raw", nvme="shuffle_lz4", device=device)
    assert m.demote(block(1))  # an exact suffix, demoted while its prefix is on the device
    assert not m.demote(block(0, lossy=True))  # the prefix, lossy: nowhere to go
    device.clear()
    assert held(m, 0) == [] and held(m, 1) == []  # its suffix would be unreachable: gone too
    assert m.stats.lossy_refused == 2 and list(tmp_path.iterdir()) == []
    m.check_integrity()
    m.close()


def test_a_block_leaving_a_quantized_tier_never_lands_in_a_lossless_one(tmp_path: Path) -> None:
    """Pushed down when DRAM needs room, and spilled at a graceful stop: an int8 DRAM block is
    lossy, so a raw NVMe tier below does not take it (it would serve it as exact KV after a
    restart, and to peers)."""
    device = set(CHAIN[:3])  # the device holds the chain while it demotes it
    m = manager(tmp_path, dram="int8", nvme="raw", dram_blocks=2, device=device)
    for i in range(3):  # the third needs room: the oldest leaf (block 1) leaves DRAM
        m.demote(block(i))
    assert [held(m, i) for i in range(3)] == [["dram"], [], ["dram"]]
    m.spill()
    assert [held(m, i) for i in range(3)] == [[], [], []]
    assert m.tier("nvme").entries() == {} and list(tmp_path.iterdir()) == []
    assert m.stats.lossy_refused == 3
    m.check_integrity()
    m.close()


def test_spill_keeps_lossy_blocks_in_a_quantized_nvme_tier(tmp_path: Path) -> None:
    m = manager(tmp_path, dram="int8", nvme="int8")
    for i in range(3):
        m.demote(block(i))
    m.spill()
    assert [held(m, i) for i in range(3)] == [["nvme"]] * 3
    result = m.read([("nvme", CHAIN[:3])])
    assert len(result.blocks) == 3 and all(b.lossy for b in result.blocks)
    assert m.stats.lossy_refused == 0
    m.close()


@pytest.mark.parametrize("shared_mode", ["raw", "int8"])
def test_lossy_blocks_are_shared_only_under_a_quantized_codec(
    tmp_path: Path, redis_url: str, shared_mode: str
) -> None:
    redis_tier = RedisTier(redis_url, namespace=uuid.uuid4().hex)
    m = manager(tmp_path, dram="int8", nvme="raw", shared=redis_tier, redis=shared_mode)
    assert m.shares_lossy == (shared_mode == "int8")
    m.demote(block(0))  # now an int8 blob in DRAM
    assert m.note_reuse([CHAIN[0]]) == [CHAIN[0]]
    assert m.share_held(CHAIN[0]) == m.shares_lossy  # from the int8 DRAM tier
    assert m.share(block(1, lossy=True)) == m.shares_lossy  # a lossy device block
    assert m.share(block(2))  # exact KV goes to any shared tier
    redis_tier.flush()
    assert redis_tier.contains_prefix(CHAIN[:3]) == (3 if m.shares_lossy else 0)
    assert redis_tier.contains_prefix(CHAIN[2:3]) == 1
    if m.shares_lossy:
        result = m.read([("redis", CHAIN[:2])])
        assert len(result.blocks) == 2 and all(b.lossy for b in result.blocks)
    else:
        assert m.stats.lossy_refused == 2
    m.close()


def test_a_failed_read_does_not_forget_what_was_shared_a_restart_does(
    tmp_path: Path, own_redis: LocalRedis
) -> None:
    """The worker sends each popular block to Redis once. A read that times out (a frozen
    Redis) says nothing about what Redis holds: the worker still knows what it sent. A Redis
    that restarted kept nothing (no persistence): then every block is worth sending again."""
    shared = RedisTier(own_redis.url, namespace="x", read_timeout_s=0.2, max_failures=10)
    m = manager(tmp_path, dram="raw", nvme="raw", shared=shared)
    h = CHAIN[0]
    assert m.note_reuse([h]) == [h] and m.share(block(0))
    shared.flush()
    assert m.note_reuse([h]) == []  # sent already
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        assert shared.contains_prefix([h]) == 0  # a read that times out: a miss
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert shared.stats.errors == 1
    assert shared.contains_prefix([h]) == 1  # answering again, the same server
    m.poll()
    assert m.note_reuse([h]) == []  # still known as sent: not sent again
    assert shared.stats.restarts == 0
    own_redis.stop(kill=True)
    assert shared.contains_prefix([h]) == 0  # down: an error
    own_redis.start()
    assert shared.contains_prefix([h]) == 0  # a new server, empty
    assert shared.stats.restarts == 1
    m.poll()
    assert m.note_reuse([h]) == [h]  # forgotten: worth sending again
    assert m.share(block(0))
    m.close()
