"""DRAM and NVMe tiers under an eviction policy: the victims they offer the manager
(`oldest`) follow it, and a restarted NVMe tier keeps what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.kv.config import ConfigError, TierConfig
from cachesvc.kv.tiers.base import Tier, TierItem
from cachesvc.kv.tiers.configured import build_tiers
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier
from cachesvc.kv.types import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def item(i: int) -> TierItem:
    return TierItem(h(i), None, bytes([i % 256]) * 100)


def _scan_after_hot(tier: Tier) -> list[BlockHash]:
    """Two blocks read back twice, then six blocks stored once; the first victims offered."""
    tier.put([item(0), item(1)])
    for _ in range(2):
        tier.get([h(0), h(1)])
    tier.put([item(i) for i in range(10, 16)])
    return tier.oldest(2)


@pytest.mark.parametrize("policy", ["slru", "s3fifo"])
def test_dram_offers_the_scan_before_the_hot_blocks(policy: str) -> None:
    tier = DramTier(capacity_mb=1, slot_bytes=128, policy=policy)
    assert _scan_after_hot(tier) == [h(10), h(11)]


def test_dram_under_lru_offers_the_hot_blocks_first() -> None:
    assert _scan_after_hot(DramTier(capacity_mb=1, slot_bytes=128)) == [h(0), h(1)]


@pytest.mark.parametrize(("policy", "prefix_at"), [("fanout_lru", 9), ("lru", 0)])
def test_dram_under_fanout_offers_a_three_chain_prefix_last(policy: str, prefix_at: int) -> None:
    tier = DramTier(capacity_mb=1, slot_bytes=128, policy=policy)
    tier.put([item(0)])
    tier.put([TierItem(h(i), h(0), bytes([i]) * 100) for i in (1, 2, 3)])  # three chains
    tier.put([item(i) for i in range(10, 16)])
    assert tier.oldest(10).index(h(0)) == prefix_at


def test_nvme_follows_its_policy_and_restarts_holding_the_same(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1, policy="slru")
    assert _scan_after_hot(tier) == [h(10), h(11)]
    tier.flush()
    held = tier.entries()
    tier.remove([h(10)])
    tier.close()
    again = NvmeTier(tmp_path, capacity_mb=1, policy="slru")
    assert set(again.entries()) == set(held) - {h(10)}
    again.close()


def test_tier_config_passes_the_policy_and_refuses_unknown_ones(tmp_path: Path) -> None:
    config = TierConfig(dram_mb=1, nvme_path=str(tmp_path), nvme_mb=1, eviction_policy="slru")
    local, _ = build_tiers(config, "fp", block_bytes=128)
    for tier in local:
        assert _scan_after_hot(tier) == [h(10), h(11)]
        tier.close()
    with pytest.raises(ConfigError, match="tiers.eviction_policy"):
        TierConfig(eviction_policy="random")
