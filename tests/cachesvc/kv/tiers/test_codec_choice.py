"""The "auto" codec: a tier keeps the codec whose fetch reads and decodes fastest, measured on
the tier itself (real DRAM tiers, one throttled like a slow link)."""

from __future__ import annotations

import numpy as np

from cachesvc.kv.calibration import default_tier_cost, probe_codecs
from cachesvc.kv.codec import Codec
from cachesvc.kv.config import AUTO_CODECS, TierConfig
from cachesvc.kv.tiers.dram import DramTier

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


def test_a_quantized_mode_would_win_a_slow_link_but_auto_never_offers_it() -> None:
    """On a slow link int8 reads a quarter of the bytes, so a probe that offered it would pick
    it; "auto" offers only lossless modes, since a quantized one changes the model's output."""
    from cachesvc.kv.config import QUANTIZED_CODECS

    array = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    tier = DramTier(capacity_mb=16, slot_bytes=array.nbytes + 4096, cap_mb_per_s=50)
    prior = default_tier_cost("dram", array.nbytes)
    offered = probe_codecs(tier, Codec(FP), (*AUTO_CODECS, "int8"), "float32", array, prior)
    assert offered is not None and offered[0].mode == "int8"
    mode, _ = _probe(array, cap_mb_per_s=50)
    assert mode in AUTO_CODECS and mode not in QUANTIZED_CODECS


def test_the_crossover_moves_with_the_codec() -> None:
    """A capped tier is not probed: its cost is the prior under its codec (`codec_cost`), whose
    bytes per block and decode time the planner uses. Where fetching the raw prefix is slower
    than recomputing it, fetching it in int8 (~3.7x fewer bytes) is faster."""
    from cachesvc.kv.calibration import CostTracker, codec_cost
    from cachesvc.kv.planner import ComputeCost, plan_load
    from cachesvc.kv.tiers.results import TierHit

    array = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    prior = default_tier_cost("dram", array.nbytes + 4096)
    compute = ComputeCost(alpha_s=0.0, beta_s=0.6e-3, gamma_s=0.0)  # 256 tokens: 154 ms
    plans = {}
    for mode in ("raw", "int8"):
        cost = codec_cost(Codec(FP, mode), "float32", array, prior)
        costs = CostTracker(compute, {"dram": cost})
        costs.set_cap("dram", 50)  # MB/s: a raw block reads in 15 ms, an int8 one in 4 ms
        plans[mode] = plan_load([TierHit("dram", 0, 16)], 0, 16 * 16 + 1, 16, costs.model())
        assert cost.seconds_per_byte > prior.seconds_per_byte  # the decode is in it
    raw, int8 = plans["raw"], plans["int8"]
    assert Codec(FP, "int8").max_blob_size("float32", SHAPE) * 3.5 < array.nbytes
    assert raw.fetch_only_s > raw.recompute_only_s
    assert int8.fetch_only_s < int8.recompute_only_s and int8.fetch_only_s < raw.fetch_only_s / 3
    assert int8.predicted_s < raw.predicted_s
