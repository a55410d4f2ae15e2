"""Retention and tenant quotas in the local tiers (DRAM and NVMe, each alone under a manager):
retained blocks outlive a flood, lower classes go first, an expired retention is an ordinary
block again, a tenant's retention budget trims only its own, tenants over their share are
evicted first, a closed session's blocks lose their retention, and NVMe keeps retentions over a
restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cachesvc.kv.codec import Codec, KVBlock
from cachesvc.kv.events import EventLog
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.tiers.base import Tier, TierItem
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash

FP = "cd" * 16
CODEC = Codec(FP, "raw")
T0 = 1_000_000.0


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def block(i: int) -> KVBlock:
    """A first block (no parent: every block is a leaf) whose KV is derived from `i`."""
    return KVBlock(h(i), None, "float32", np.full((1, 1, 1, 1, 4), i, np.float32))


BLOB = len(CODEC.encode(h(0), None, "float32", block(0).array))
TierMaker = Callable[[int, Clock], Tier]


def dram(num_blocks: int, clock: Clock) -> Tier:
    return DramTier(capacity_mb=num_blocks * BLOB / 2**20, slot_bytes=BLOB, clock=clock)


@pytest.fixture(params=["dram", "nvme"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> TierMaker:
    if request.param == "dram":
        return dram
    return lambda n, clock: NvmeTier(tmp_path / "kv", capacity_mb=n * BLOB / 2**20, clock=clock)


def alone(tier: Tier) -> TierManager:
    return TierManager([tier], None, {tier.name: CODEC}, EventLog())


def keep(cls: int, seconds: float, tenant: str = "a", session: str | None = None) -> Retention:
    return Retention(cls, T0 + seconds, tenant, session)


def held(m: TierManager, ids: range | list[int]) -> list[int]:
    return [i for i in ids if m.held_locally(h(i))]


def test_retained_blocks_outlive_a_flood(make: TierMaker) -> None:
    m = alone(make(8, Clock()))
    for i in range(3):
        assert m.demote(block(i), keep(SHORT, 300))
    for i in range(100, 160):  # a flood of unretained blocks, far more than the tier holds
        m.demote(block(i))
    assert held(m, range(3)) == [0, 1, 2]
    assert held(m, range(100, 160)) == list(range(155, 160))  # the newest of the flood
    m.check_integrity()


def test_a_shorter_class_goes_before_a_longer_one(make: TierMaker) -> None:
    m = alone(make(8, Clock()))
    m.set_quotas({"a": TenantQuota(retention_share=1.0)})
    for i in range(2):
        m.demote(block(i), keep(LONG, 7200))
    for i in range(100, 120):  # the tier is full of retained blocks: the short class gives way
        m.demote(block(i), keep(SHORT, 300))
    assert held(m, range(2)) == [0, 1]
    assert held(m, range(100, 120)) == list(range(114, 120))
    assert m.tier(m.local[0].name).retention_of(h(0)) == keep(LONG, 7200)


def test_an_expired_retention_is_an_ordinary_block_again(make: TierMaker) -> None:
    clock = Clock()
    tier = make(4, clock)
    m = alone(tier)
    m.demote(block(0), keep(SHORT, 60))
    for i in range(100, 110):
        m.demote(block(i))
    assert held(m, [0]) == [0] and tier.retention_of(h(0)) == keep(SHORT, 60)
    clock.now = T0 + 60  # expired: nothing ran meanwhile, the next question notices
    assert tier.retention_of(h(0)) is None
    assert tier.tenant_blocks()["a"] == TenantBlocks(cached=1, retained=0)
    for i in range(200, 210):
        m.demote(block(i))
    assert held(m, [0]) == []  # flooded out like any unretained block
    m.check_integrity()


def test_the_retention_budget_trims_only_the_same_tenants_oldest(make: TierMaker) -> None:
    tier = make(10, Clock())
    m = alone(tier)
    m.set_quotas({"a": TenantQuota(retention_share=0.3)})  # 3 blocks; b's default is 5
    for i in range(3):
        m.demote(block(i), keep(SHORT, 300, tenant="b"))
    for i in range(10, 15):
        m.demote(block(i), keep(SHORT, 300, tenant="a"))
    retained = [i for i in [0, 1, 2, *range(10, 15)] if tier.retention_of(h(i)) is not None]
    assert retained == [0, 1, 2, 12, 13, 14]  # a's two oldest were demoted, none of b's
    assert held(m, range(10, 15)) == list(range(10, 15))  # demoted, still cached
    assert m.tenant_blocks() == {tier.name: {"a": TenantBlocks(5, 3), "b": TenantBlocks(3, 3)}}
    m.set_quotas({"a": TenantQuota(retention_share=0.1)})  # a budget that shrinks trims at once
    assert [i for i in range(10, 15) if tier.retention_of(h(i))] == [14]
    for i in range(100, 120):
        m.demote(block(i))
    assert held(m, [0, 1, 2, 12, 13, 14]) == [0, 1, 2, 14]
    m.check_integrity()


def test_tenants_over_their_share_are_evicted_first(make: TierMaker) -> None:
    m = alone(make(10, Clock()))
    m.set_quotas({"a": TenantQuota(share=0.3), "b": TenantQuota(share=0.5)})
    for i in range(4):  # b's blocks are the oldest, but b is under its share (5)
        m.demote(block(i), tenant="b")
    for i in range(10, 16):  # a holds 6, 3 over its share
        m.demote(block(i), tenant="a")
    m.demote(block(100), tenant="c")
    m.demote(block(101), tenant="c")
    assert held(m, range(4)) == [0, 1, 2, 3]
    assert held(m, range(10, 16)) == [12, 13, 14, 15]  # a's own oldest went
    m.check_integrity()


def test_the_most_over_share_goes_first(make: TierMaker) -> None:
    m = alone(make(10, Clock()))
    m.set_quotas({"a": TenantQuota(share=0.2), "b": TenantQuota(share=0.1)})
    for i in range(5):  # a: 3 over
        m.demote(block(i), tenant="a")
    for i in range(10, 15):  # b: 4 over, and newer
        m.demote(block(i), tenant="b")
    m.demote(block(100))
    assert held(m, range(10, 15)) == [11, 12, 13, 14] and held(m, range(5)) == list(range(5))
    m.demote(block(101))  # now both are 3 over: either may go, but not the newcomer
    assert len(held(m, [*range(5), *range(10, 15)])) == 8 and held(m, [100]) == [100]


def test_closing_a_session_ends_only_its_retentions() -> None:
    clock = Clock()
    d = dram(8, clock)
    m = alone(d)
    for i in range(3):
        m.demote(block(i), keep(SHORT, 300, session="s1"))
    m.demote(block(3), keep(SHORT, 300, session="s2"))
    m.demote(block(4), keep(SHORT, 300, tenant="b", session="s1"))
    assert m.close_session("a", "s1") == 3
    assert [i for i in range(5) if d.retention_of(h(i))] == [3, 4]
    assert held(m, range(5)) == list(range(5))  # still cached, no longer retained
    assert m.close_session("a", "s1") == 0


def test_nvme_keeps_retentions_over_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    nvme = NvmeTier(tmp_path, capacity_mb=8 * BLOB / 2**20, clock=clock)
    data = bytes(BLOB)
    nvme.put([TierItem(h(0), None, data, keep(LONG, 7200, session="s"))])
    nvme.put([TierItem(h(1), None, data, keep(SHORT, 60))])
    nvme.put([TierItem(h(2), None, data, keep(SHORT, 300, tenant="b", session="t"))])
    nvme.put([TierItem(h(i), None, data) for i in range(3, 6)])
    nvme.retain(h(3), keep(SHORT, 600))  # retained after it was stored
    assert nvme.end_session("b", "t") == 1  # ended before the restart: stays ended
    nvme.flush()
    nvme.close()

    clock.now = T0 + 100  # h(1)'s retention expired while the worker was down
    again = NvmeTier(tmp_path, capacity_mb=8 * BLOB / 2**20, clock=clock)
    assert set(again.entries()) == {h(i) for i in range(6)}
    assert [again.retention_of(h(i)) for i in range(6)] == [
        keep(LONG, 7200, session="s"),
        None,
        None,
        keep(SHORT, 600),
        None,
        None,
    ]
    m = alone(again)
    for i in range(100, 120):
        m.demote(block(i))
    assert held(m, range(6)) == [0, 3]
    again.close()


def test_dram_drops_retentions_when_closed() -> None:
    d = dram(4, Clock())
    d.put([TierItem(h(0), None, bytes(BLOB), keep(SHORT, 60))])
    d.close()
    assert d.entries() == {} and d.tenant_blocks() == {}


def test_a_newcomer_never_displaces_a_higher_class(make: TierMaker) -> None:
    m = alone(make(2, Clock()))
    m.set_quotas({"a": TenantQuota(retention_share=1.0)})
    m.demote(block(0), keep(LONG, 7200))
    m.demote(block(1), keep(SHORT, 300))
    assert not m.demote(block(2))  # unretained, and every victim outranks it: nowhere to go
    assert m.demote(block(3), keep(LONG, 7200))  # outranks the short one
    assert held(m, range(4)) == [0, 3]
    assert not m.demote(block(4), keep(SHORT, 300))
    assert held(m, range(5)) == [0, 3]


def test_nvme_restart_keeps_retentions_until_the_quotas_come(tmp_path: Path) -> None:
    clock = Clock()
    nvme = NvmeTier(tmp_path, capacity_mb=4 * BLOB / 2**20, clock=clock)
    nvme.set_quotas({"a": TenantQuota(retention_share=1.0)})
    nvme.put([TierItem(h(i), None, bytes(BLOB), keep(SHORT, 60 + i)) for i in range(4)])
    nvme.flush()
    nvme.close()
    again = NvmeTier(tmp_path, capacity_mb=4 * BLOB / 2**20, clock=clock)
    assert again.tenant_blocks() == {"a": TenantBlocks(4, 4)}  # not trimmed to the default
    again.set_quotas({"a": TenantQuota(retention_share=0.5)})
    assert [i for i in range(4) if again.retention_of(h(i))] == [2, 3]
    again.close()
