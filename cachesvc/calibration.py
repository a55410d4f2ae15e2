"""The planner's cost model, kept current: calibrated at start, then updated from measurements.

`CostTracker` holds the coefficients and folds in every measured tier read (EWMA) and every
measured forward pass (a refit weighted toward recent passes), so the plan follows a tier that
slows down (a busy disk, a throttled link, a loaded Redis) or a device that speeds up once warm.
`probe_tier` measures one tier at start with a few synthetic blocks.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cachesvc.planner import ComputeCost, CostModel, TierCost
from cachesvc.tiers.base import Tier, TierItem
from cachesvc.tiers.results import Transfer
from cachesvc.types import BlockHash

# Prior read costs before any measurement (latency s, seconds per byte): order of magnitude only.
DEFAULT_TIER_COSTS: Mapping[str, tuple[float, float]] = {
    "dram": (20e-6, 1 / 5e9),
    "nvme": (200e-6, 1 / 1e9),
    "redis": (500e-6, 1 / 0.5e9),
}
_CLAMP = (0.25, 4.0)  # one measurement moves a coefficient by at most this factor
_MAX_BYTES_PER_S = 100e9  # a floor on measured read time, against timer noise


@dataclass(frozen=True)
class ComputeSample:
    """One measured forward pass: its new tokens, its attention work, and its time."""

    num_tokens: float  # sum of k over the chunks
    attention: float  # sum of k * (ctx + k / 2)
    seconds: float

    @classmethod
    def of(cls, chunks: Sequence[tuple[int, int]], seconds: float) -> ComputeSample:
        """From the (new tokens, context) of each chunk of the pass."""
        return cls(
            float(sum(k for k, _ in chunks)),
            float(sum(k * (ctx + k / 2) for k, ctx in chunks)),
            seconds,
        )


class CostTracker:
    """Mutable coefficients of the cost model; `model()` snapshots them.

    Tier reads fold in by EWMA. The compute cost is refitted after every forward pass to the
    calibration samples (kept as anchors: they span short and long prefills) plus the recent
    passes with exponentially decaying weights, so it follows the device without forgetting
    what a long prefill costs during a long run of decode steps.
    """

    def __init__(
        self,
        compute: ComputeCost,
        tiers: Mapping[str, TierCost],
        weight: float = 0.3,
        window: int = 32,
    ) -> None:
        self.compute = compute
        self.tiers = dict(tiers)
        self.weight = weight
        # Until calibrated, the prior itself is a weak anchor.
        self._anchors = [ComputeSample.of([(k, c)], compute.prefill_s(k, c)) for k, c in _SHAPES]
        self._anchor_weight = 0.05
        self._recent: deque[ComputeSample] = deque(maxlen=window)

    def model(self) -> CostModel:
        return CostModel(self.compute, dict(self.tiers))

    def calibrate_compute(self, samples: Sequence[ComputeSample]) -> None:
        """Start from measured passes (they stay in every later fit)."""
        self._anchors = list(samples)
        self._anchor_weight = 0.5
        self._recent.clear()
        self.compute = fit_compute(samples)

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
        """Fold in one forward pass over `chunks` of (new tokens, context) that took `seconds`."""
        if seconds <= 0 or not chunks:
            return
        self._recent.append(ComputeSample.of(chunks, seconds))
        n = len(self._recent)
        weights = [self._anchor_weight] * len(self._anchors) + [
            (1 - self.weight) ** (n - 1 - i) for i in range(n)
        ]
        self.compute = fit_compute([*self._anchors, *self._recent], weights)

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new


def _clamped(value: float, reference: float) -> float:
    lo, hi = _CLAMP
    return min(max(value, reference * lo), reference * hi)


# Calibration shapes (new tokens, context), in units of the engine's short and long prefills.
_SHAPES = ((32, 0), (128, 0), (32, 128), (128, 128))
# Subsets of (alpha, beta, gamma) tried by the non-negative fit; beta is always in: a
# recompute is never free.
_SUBSETS = ((1,), (0, 1), (1, 2), (0, 1, 2))


def fit_compute(
    samples: Sequence[ComputeSample], weights: Sequence[float] | None = None
) -> ComputeCost:
    """Non-negative weighted least squares fit of alpha, beta, gamma to measured passes.

    Tries each subset of coefficients (the others zero) and keeps the best fit whose
    coefficients are all non-negative: noise never yields a negative cost.
    """
    import numpy as np  # only when fitting

    x = np.array([[1.0, s.num_tokens, s.attention] for s in samples])
    y = np.array([s.seconds for s in samples])
    w = np.sqrt(np.array(weights if weights is not None else [1.0] * len(samples)))
    best: tuple[float, np.ndarray] | None = None
    for subset in _SUBSETS:
        cols = list(subset)
        coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        residual = float((((x @ full) - y) * w) @ (((x @ full) - y) * w))
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None or best[1][1] <= 0:
        per_token = max(s.seconds / max(s.num_tokens, 1.0) for s in samples)
        return ComputeCost(0.0, per_token, 0.0)
    alpha, beta, gamma = (float(v) for v in best[1])
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
