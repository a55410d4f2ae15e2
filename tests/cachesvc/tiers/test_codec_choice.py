"""The "auto" codec: a tier keeps the codec whose fetch reads and decodes fastest, measured on
the tier itself (real DRAM tiers, one throttled like a slow link)."""

from __future__ import annotations

import numpy as np

from cachesvc.calibration import default_tier_cost, probe_codecs
from cachesvc.codec import Codec
from cachesvc.config import AUTO_CODECS, TierConfig
from cachesvc.tiers.dram import DramTier

FP = "ab" * 16
SHAPE = (30, 2, 16, 3, 64)  # SmolLM2: layers, K/V, block, kv heads, head dim


def _probe(array: np.ndarray, cap_mb_per_s: float | None) -> tuple[str, DramTier]:
    tier = DramTier(capacity_mb=16, slot_bytes=array.nbytes + 4096, cap_mb_per_s=cap_mb_per_s)
    prior = default_tier_cost("dram", array.nbytes)
    probed = probe_codecs(tier, Codec(FP), AUTO_CODECS, "float32", array, prior)
    assert probed is not None
    codec, cost = probed
    assert cost is not prior and cost.bytes_per_block > 0
    return codec.mode, tier


def test_a_fast_tier_keeps_incompressible_kv_raw() -> None:
    # Random normal values compress ~1.07x: decoding costs more than the bytes it saves.
    array = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    mode, tier = _probe(array, cap_mb_per_s=None)
    assert mode == "raw"
    assert tier.entries() == {}  # the probes leave nothing behind


def test_a_slow_link_compresses_what_compresses() -> None:
    array = np.zeros(SHAPE, dtype=np.float32)  # lz4 shrinks it ~250x
    mode, _ = _probe(array, cap_mb_per_s=50)
    assert mode == "shuffle_lz4"


def test_a_refused_probe_is_no_choice() -> None:
    array = np.zeros(SHAPE, dtype=np.float32)
    tier = DramTier(capacity_mb=0.1, slot_bytes=array.nbytes + 4096)  # no slot at all
    prior = default_tier_cost("dram", array.nbytes)
    assert probe_codecs(tier, Codec(FP), AUTO_CODECS, "float32", array, prior) is None


def test_auto_is_the_default_below_dram_and_valid_in_config() -> None:
    config = TierConfig()
    assert config.codecs == {"dram": "raw", "nvme": "auto", "redis": "auto"}
    assert TierConfig(dram_codec="auto").codecs["dram"] == "auto"
