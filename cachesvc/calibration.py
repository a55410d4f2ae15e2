"""The planner's cost model, kept current: calibrated at start, then updated from measurements.

`CostTracker` holds the coefficients and folds in every measured tier read and every measured
forward pass with an exponentially weighted moving average (EWMA), so the plan follows a tier
that slows down (a busy disk, a throttled link, a loaded Redis) or a device that speeds up once
warm. `probe_tier` measures one tier at start with a few synthetic blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from cachesvc.planner import ComputeCost, CostModel, TierCost
from cachesvc.tiers.base import Tier, TierItem
from cachesvc.tiers.tier_manager import Transfer
from cachesvc.types import BlockHash

# Prior read costs before any measurement (latency s, seconds per byte): order of magnitude only.
DEFAULT_TIER_COSTS: Mapping[str, tuple[float, float]] = {
    "dram": (20e-6, 1 / 5e9),
    "nvme": (200e-6, 1 / 1e9),
    "redis": (500e-6, 1 / 0.5e9),
}
_CLAMP = (0.25, 4.0)  # one measurement moves a coefficient by at most this factor
_MAX_BYTES_PER_S = 100e9  # a floor on measured read time, against timer noise


class CostTracker:
    """Mutable coefficients of the cost model, updated by EWMA; `model()` snapshots them."""

    def __init__(self, compute: ComputeCost, tiers: Mapping[str, TierCost], weight: float = 0.3):
        self.compute = compute
        self.tiers = dict(tiers)
        self.weight = weight

    def model(self) -> CostModel:
        return CostModel(self.compute, dict(self.tiers))

    def observe_transfer(self, t: Transfer) -> None:
        """Fold in one measured read (`seconds` include the throttle and the decode)."""
        cost = self.tiers.get(t.tier)
        if cost is None or t.num_blocks == 0 or t.num_bytes == 0:
            return
        per_byte = max(t.seconds - cost.latency_s, 0.0) / t.num_bytes
        per_byte = _clamped(per_byte, cost.seconds_per_byte)
        size = t.num_bytes / t.num_blocks
        self.tiers[t.tier] = replace(
            cost,
            seconds_per_byte=self._ewma(cost.seconds_per_byte, per_byte),
            bytes_per_block=self._ewma(cost.bytes_per_block, size),
        )

    def observe_compute(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """Fold in one forward pass over `chunks` of (new tokens, context) that took `seconds`:
        all coefficients scale by the ratio of measured to predicted time."""
        c = self.compute
        predicted = c.alpha_s + sum(
            c.beta_s * k + c.gamma_s * k * (ctx + k / 2) for k, ctx in chunks
        )
        if predicted <= 0 or seconds <= 0:
            return
        scale = self._ewma(1.0, _clamped(seconds / predicted, 1.0))
        self.compute = ComputeCost(c.alpha_s * scale, c.beta_s * scale, c.gamma_s * scale)

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new


def _clamped(value: float, reference: float) -> float:
    lo, hi = _CLAMP
    return min(max(value, reference * lo), reference * hi)


def fit_compute(samples: Sequence[tuple[int, int, float]]) -> ComputeCost:
    """Least squares fit of alpha, beta, gamma to (new tokens, context, seconds) samples.

    Negative coefficients (noise) are clamped to zero; beta is kept positive so a recompute is
    never free.
    """
    import numpy as np  # only at calibration

    rows = [[1.0, k, k * (ctx + k / 2)] for k, ctx, _ in samples]
    secs = [s for _, _, s in samples]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(secs), rcond=None)
    alpha, beta, gamma = (max(float(x), 0.0) for x in coef)
    if beta <= 0:
        beta = max(secs) / max(k for k, _, _ in samples)
    return ComputeCost(alpha, beta, gamma)


def default_tier_cost(name: str, bytes_per_block: float, cap_mb_per_s: float | None) -> TierCost:
    """The prior of a tier before it is probed: the default, or its configured cap."""
    latency, per_byte = DEFAULT_TIER_COSTS.get(name, (1e-3, 1 / 1e8))
    if cap_mb_per_s is not None:
        per_byte = max(per_byte, 1 / (cap_mb_per_s * 1e6))
    return TierCost(latency, per_byte, bytes_per_block)


def probe_tier(tier: Tier, blobs: Sequence[bytes], prior: TierCost) -> TierCost:
    """Time one batched read of `blobs` (written under random hashes, then removed).

    Returns `prior` unchanged when the tier refuses the probe (full, down). The write to an NVMe
    tier lands in memory first, so a fresh probe measures the page cache, not the drive: the
    online updates correct it as real reads come.
    """
    hashes = [BlockHash(os.urandom(16)) for _ in blobs]
    items = [TierItem(h, None, b) for h, b in zip(hashes, blobs, strict=True)]
    if len(tier.put(items)) != len(items):
        tier.remove(hashes)
        return prior
    flush = getattr(tier, "flush", None)
    if flush is not None:
        flush()
    try:
        start = time.perf_counter()
        tier.get(hashes[:1])
        latency = time.perf_counter() - start
        start = time.perf_counter()
        got = tier.get(hashes)
        seconds = time.perf_counter() - start
    finally:
        tier.remove(hashes)
    num_bytes = sum(len(b) for b in got if b is not None)
    if num_bytes == 0 or len(blobs) < 2:
        return prior
    size = num_bytes / len(blobs)
    # t(1) = latency + one block, t(n) = latency + n blocks: two equations, two unknowns.
    per_block = max((seconds - latency) / (len(blobs) - 1), size / _MAX_BYTES_PER_S)
    return TierCost(max(latency - per_block, 0.0), per_block / size, size)
