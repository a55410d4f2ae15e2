"""Retention down the tiers: a block demoted from the device keeps its retention in DRAM, then
in NVMe when DRAM gives it up (and on spill), and when demoted again while held its retention
merges; a block shared to a real Redis lives there until its retention ends."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import redis

from cachesvc.kv.codec import Codec, KVBlock
from cachesvc.kv.events import EventLog
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.tiers.base import TierItem
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier
from cachesvc.kv.tiers.redis_tier import RedisTier
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash

FP = "ef" * 16
CODECS = {n: Codec(FP, "raw" if n == "dram" else "shuffle_lz4") for n in ("dram", "nvme", "redis")}
T0 = 2_000_000.0


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def block(i: int, parent: int | None = None) -> KVBlock:
    p = None if parent is None else h(parent)
    return KVBlock(h(i), p, "float32", np.full((1, 1, 1, 1, 4), i, np.float32))


BLOB = len(CODECS["dram"].encode(h(0), None, "float32", block(0).array))


def keep(cls: int, seconds: float, tenant: str = "a") -> Retention:
    return Retention(cls, T0 + seconds, tenant)


def chain_manager(tmp: Path, dram_blocks: int) -> tuple[TierManager, DramTier, NvmeTier]:
    clock = lambda: T0  # noqa: E731  # the wall clock, stopped
    dram = DramTier(capacity_mb=dram_blocks * BLOB / 2**20, slot_bytes=BLOB, clock=clock)
    nvme = NvmeTier(tmp, capacity_mb=50 * BLOB / 2**20, clock=clock)
    return TierManager([dram, nvme], None, CODECS, EventLog()), dram, nvme


def test_device_to_dram_to_nvme_keeps_retention(tmp_path: Path) -> None:
    m, dram, nvme = chain_manager(tmp_path, dram_blocks=2)
    m.set_quotas({"a": TenantQuota(retention_share=1.0)})
    m.demote(block(0), keep(LONG, 7200))  # a chain: 0 <- 1 <- 2
    m.demote(block(1, parent=0), keep(SHORT, 600, tenant="a"))
    assert dram.retention_of(h(0)) == keep(LONG, 7200)
    for i in range(10, 14):  # unretained blocks pass through: the retained ones stay in DRAM
        m.demote(block(i))
    assert m.held_locally(h(0)) == {"dram"} and m.held_locally(h(1)) == {"dram"}
    m.demote(block(2, parent=1), keep(LONG, 3600, tenant="b"))
    # DRAM is all retained: the short class (h(1), a leaf) goes down, its retention with it.
    assert m.held_locally(h(1)) == {"nvme"}
    assert nvme.retention_of(h(1)) == keep(SHORT, 600)
    assert nvme.tenant_of(h(1)) == "a"
    m.demote(block(1, parent=0), keep(LONG, 900))  # held: its copies' retention merges
    assert nvme.retention_of(h(1)) == Retention(LONG, T0 + 900, "a")
    m.spill()
    assert nvme.retention_of(h(0)) == keep(LONG, 7200)
    assert nvme.retention_of(h(2)) == keep(LONG, 3600, tenant="b")
    assert m.tenant_blocks() == {
        "dram": {},
        "nvme": {"a": TenantBlocks(2, 2), "b": TenantBlocks(1, 1), "": TenantBlocks(4, 0)},
    }
    m.check_integrity()
    m.close()


def test_a_retained_key_lives_in_redis_until_its_retention_ends(redis_url: str) -> None:
    clock = lambda: T0  # noqa: E731
    tier = RedisTier(redis_url, namespace=uuid.uuid4().hex, ttl_s=60, clock=clock)
    forever = RedisTier(redis_url, namespace=uuid.uuid4().hex, clock=clock)
    data = b"kv" * 100
    tier.put([TierItem(h(0), None, data, keep(LONG, 7200))])
    tier.put([TierItem(h(1), None, data)])
    tier.put([TierItem(h(2), None, data, keep(SHORT, 10))])  # ends before the tier's TTL
    forever.put([TierItem(h(0), None, data, keep(LONG, 7200))])
    tier.flush()
    forever.flush()
    client = redis.Redis.from_url(redis_url)
    assert 7100 < client.ttl(tier.key(h(0))) <= 7200
    assert 0 < client.ttl(tier.key(h(1))) <= 60
    assert 10 < client.ttl(tier.key(h(2))) <= 60
    assert client.ttl(forever.key(h(0))) == -1  # no default TTL: keys never expire
    tier.close()
    forever.close()


def test_a_shared_block_takes_its_retention_to_redis(tmp_path: Path, redis_url: str) -> None:
    shared = RedisTier(redis_url, namespace=uuid.uuid4().hex, ttl_s=60, clock=lambda: T0)
    dram = DramTier(capacity_mb=4 * BLOB / 2**20, slot_bytes=BLOB, clock=lambda: T0)
    m = TierManager([dram], shared, CODECS, EventLog(), min_reuse=1)
    m.demote(block(0), keep(LONG, 7200))
    assert m.note_reuse([h(0)]) == [h(0)] and m.share_held(h(0))
    m.share(block(1), keep(SHORT, 1800))  # from the device
    shared.flush()
    client = redis.Redis.from_url(redis_url)
    assert 7100 < client.ttl(shared.key(h(0))) <= 7200
    assert 1700 < client.ttl(shared.key(h(1))) <= 1800
    m.close()
