"""The planner's cost model, kept current: calibrated at start, then updated from measurements.

`CostTracker` holds the coefficients and folds in every measured tier read and landing (EWMA)
and every measured forward pass (a refit weighted toward recent passes), so the plan follows a
tier that slows down (a busy disk, a throttled link, a loaded Redis) or a device that speeds up
once warm. A bandwidth cap we impose ourselves (tests, benchmarks) is known exactly: it is kept
apart from the tier's own cost, which reads learn with the cap's share taken out, so changing
the cap keeps what was learned. `probe_tier` measures one tier at start with a few blocks, each
blob read and decoded under the tier's codec: a tier's bytes per block and its per-byte cost are
those of its codec (a quantized block is ~1/4 of a float32 one, its decode slower than a copy),
so the fetch-versus-recompute crossover moves with the codec. `codec_cost` does the same for a
tier that is not probed.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cachesvc.kv.codec import Codec
from cachesvc.kv.planner import ComputeCost, CostModel, TierCost
from cachesvc.kv.tiers.base import Tier, TierItem
from cachesvc.kv.tiers.results import Transfer
from cachesvc.kv.types import BlockHash

if TYPE_CHECKING:
    import numpy as np

# Prior read costs before any measurement (latency s, seconds per byte): order of magnitude only.
DEFAULT_TIER_COSTS: Mapping[str, tuple[float, float]] = {
    "dram": (20e-6, 1 / 5e9),
    "nvme": (200e-6, 1 / 1e9),
    "redis": (500e-6, 1 / 0.5e9),
    # A pull from another worker: an actor call's round trip, then ~1 GB/s (Ray's transfer
    # between processes of one node is faster, between nodes about this).
    "peer": (5e-3, 1 / 1e9),
}
_CLAMP = (0.25, 4.0)  # one measurement moves a coefficient by at most this factor
_OUTLIER_RUN = 3  # ... unless this many in a row fall outside it on the same side
_MAX_BYTES_PER_S = 100e9  # a floor on measured read time, against timer noise
_TYPICAL_FETCH_BLOCKS = 64  # codecs are compared on a fetch this long (1K tokens at 16/block)


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
        self.tiers = dict(tiers)  # each tier's own read cost, without a cap
        self.caps: dict[str, float] = {}  # seconds per byte a cap adds to a tier's reads
        self.land_s_per_block = 0.0  # until measured (the first measurement is taken as is)
        # Per tier: how much a split's overlap ends later, per byte read in the background.
        self.background_s_per_byte: dict[str, float] = {}
        self.weight = weight
        # Until calibrated, the prior itself is a weak anchor.
        self._anchors = [ComputeSample.of([(k, c)], compute.prefill_s(k, c)) for k, c in _SHAPES]
        self._anchor_weight = 0.05
        self._recent: deque[ComputeSample] = deque(maxlen=window)
        self._outliers: dict[str, list[float]] = {}  # see `_fold`

    def model(self) -> CostModel:
        tiers = {
            name: replace(c, seconds_per_byte=c.seconds_per_byte + self.caps.get(name, 0.0))
            for name, c in self.tiers.items()
        }
        return CostModel(
            self.compute, tiers, self.land_s_per_block, dict(self.background_s_per_byte)
        )

    def set_cap(self, tier: str, mb_per_s: float | None) -> None:
        """A tier's reads are capped at `mb_per_s` from now on (None: uncapped)."""
        self.caps[tier] = 0.0 if mb_per_s is None else 1 / (mb_per_s * 1e6)

    def calibrate_compute(self, samples: Sequence[ComputeSample]) -> None:
        """Start from measured passes (they stay in every later fit)."""
        self._anchors = list(samples)
        self._anchor_weight = 0.5
        self._recent.clear()
        self.compute = fit_compute(samples)

    def observe_transfer(self, t: Transfer, background: bool = False) -> None:
        """Fold in one measured read (`seconds` include the cap's wait and the decode). A
        `background` read (a split's back, run while the engine computed) does not teach the
        tier's own speed."""
        cost = self.tiers.get(t.tier)
        if cost is None or t.num_blocks == 0 or t.num_bytes == 0:
            return
        capped = t.num_bytes * self.caps.get(t.tier, 0.0)
        per_byte = max(t.seconds - cost.latency_s - capped, 0.0) / t.num_bytes
        if background:
            return  # slowed by the compute it overlapped: `observe_overlap` learns from it
        size = t.num_bytes / t.num_blocks
        self.tiers[t.tier] = replace(
            cost,
            seconds_per_byte=self._fold(f"read:{t.tier}", cost.seconds_per_byte, per_byte),
            bytes_per_block=self._ewma(cost.bytes_per_block, size),
        )

    def observe_overlap(self, transfers: Sequence[Transfer], delay_s: float) -> None:
        """Fold in one split: its front compute and back read ended `delay_s` later than the
        slower of the two was predicted to (negative: earlier). The delay is spread over the
        bytes read in the background, per tier, bounded by the clamp's multiple of each tier's
        own read cost; noise either way averages out (negative values stay in the average, the
        model uses the positive part)."""
        num_bytes = sum(t.num_bytes for t in transfers)
        if num_bytes <= 0:
            return
        for tier in {t.tier for t in transfers}:
            cost = self.tiers.get(tier)
            if cost is None:
                continue
            bound = cost.seconds_per_byte * (_CLAMP[1] - 1)
            per_byte = min(max(delay_s / num_bytes, -bound), bound)
            old = self.background_s_per_byte.get(tier)
            self.background_s_per_byte[tier] = (
                per_byte if old is None else self._ewma(old, per_byte)
            )

    def observe_land(self, num_blocks: int, seconds: float) -> None:
        """Fold in one measured copy of `num_blocks` fetched blocks into the device caches."""
        if num_blocks <= 0 or seconds <= 0:
            return
        per_block = seconds / num_blocks
        if self.land_s_per_block > 0:
            per_block = self._fold("land", self.land_s_per_block, per_block)
        self.land_s_per_block = per_block

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

    def _fold(self, key: str, old: float, new: float) -> float:
        """A coefficient after measuring `new`: an EWMA step toward it, the measurement clamped
        to the clamp's band around `old`. Measurements held back by the clamp that come
        `_OUTLIER_RUN` times in a row on the same side mean the coefficient itself is off (a
        calibration disturbed by a stall, a tier that really changed): it then jumps to their
        median instead of creeping there a clamp step at a time."""
        lo, hi = _CLAMP
        if old * lo <= new <= old * hi:
            self._outliers.pop(key, None)
            return self._ewma(old, new)
        run = self._outliers.setdefault(key, [])
        if run and (run[-1] > old) != (new > old):
            run.clear()
        run.append(new)
        if len(run) >= _OUTLIER_RUN:
            del self._outliers[key]
            return sorted(run)[len(run) // 2]
        return self._ewma(old, _clamped(new, old))


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
    rows = [(1.0, s.num_tokens, s.attention) for s in samples]
    scale = [math.sqrt(w) for w in weights] if weights is not None else None
    coef = nonneg_lstsq(rows, [s.seconds for s in samples], _SUBSETS, scale)
    if coef is None or coef[1] <= 0:
        per_token = max(s.seconds / max(s.num_tokens, 1.0) for s in samples)
        return ComputeCost(0.0, per_token, 0.0)
    alpha, beta, gamma = coef
    return ComputeCost(alpha, beta, gamma)


def nonneg_lstsq(
    rows: Sequence[Sequence[float]],
    values: Sequence[float],
    subsets: Sequence[Sequence[int]],
    scale: Sequence[float] | None = None,
) -> list[float] | None:
    """Least squares of `values` on `rows`, every coefficient >= 0: of the fits on each of
    `subsets` of the columns (the others zero), the one with the smallest residual whose
    coefficients are all >= 0 (None when no subset's are). `scale` multiplies each row's
    residual (1 / value: errors relative to it)."""
    import numpy as np  # only when fitting

    x = np.array(rows, dtype=float)
    y = np.array(values, dtype=float)
    w = np.ones(len(y)) if scale is None else np.array(scale, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for subset in subsets:
        cols = list(subset)
        coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        residual = float((((x @ full) - y) * w) @ (((x @ full) - y) * w))
        if best is None or residual < best[0]:
            best = (residual, full)
    return None if best is None else [float(v) for v in best[1]]


def default_tier_cost(name: str, bytes_per_block: float) -> TierCost:
    """The prior of a tier's own read cost before it is probed."""
    latency, per_byte = DEFAULT_TIER_COSTS.get(name, (1e-3, 1 / 1e8))
    return TierCost(latency, per_byte, bytes_per_block)


def probe_tier(
    tier: Tier,
    codec: Codec,
    dtype: str,
    array: np.ndarray,
    prior: TierCost,
    num_blocks: int = 4,
    repeats: int = 3,
) -> TierCost:
    """Time reads of one block and of `num_blocks` copies of `array` (written under random
    hashes, then removed), each blob decoded as a fetch decodes it: a compressing codec's decode
    costs more than the read itself (shuffle + lz4: ~2 GB/s).

    Returns `prior` unchanged when the tier refuses the probe (full, down). The write to an NVMe
    tier lands in memory first, so a fresh probe measures the page cache, not the drive: the
    online updates correct it as real reads come.
    """
    hashes = [BlockHash(os.urandom(16)) for _ in range(num_blocks)]
    items = [TierItem(h, None, codec.encode(h, None, dtype, array)) for h in hashes]
    if len(tier.put(items)) != len(items):
        tier.remove(hashes)
        return prior
    flush = getattr(tier, "flush", None)
    if flush is not None:
        flush()

    borrow = getattr(tier, "borrow", None)  # as a fetch that lands at once reads it

    def read(batch: Sequence[BlockHash]) -> tuple[float, int]:
        with borrow() if borrow is not None else contextlib.nullcontext():
            start = time.perf_counter()
            blobs = tier.get(batch)
            ok = [b for h, b in zip(batch, blobs, strict=True) if b and codec.decode(b, h)]
            return time.perf_counter() - start, sum(len(b) for b in ok)

    try:
        # The best of `repeats`: a single read may pay for a page fault or a busy core, and the
        # codec choice compares probes that differ by well under 2x.
        latency = min(read(hashes[:1])[0] for _ in range(repeats))
        runs = [read(hashes) for _ in range(repeats)]
        seconds, num_bytes = min(runs)
    finally:
        tier.remove(hashes)
    if num_bytes == 0 or num_blocks < 2:
        return prior
    size = num_bytes / num_blocks
    # t(1) = latency + one block, t(n) = latency + n blocks: two equations, two unknowns.
    per_block = max((seconds - latency) / (num_blocks - 1), size / _MAX_BYTES_PER_S)
    return TierCost(max(latency - per_block, 0.0), per_block / size, size)


def codec_cost(
    codec: Codec, dtype: str, array: np.ndarray, prior: TierCost, repeats: int = 3
) -> TierCost:
    """`prior` under `codec`, for a tier that is not probed (a capped one: its reads are mostly
    its cap): the bytes of `array` encoded, and per stored byte the prior's read time plus the
    decode (the best of `repeats`; a quantized block decodes at ~1-4 GB/s of KV here)."""
    block_hash = BlockHash(bytes(16))
    blob = bytearray(codec.encode(block_hash, None, dtype, array))  # decoded in place, as DRAM's
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        codec.decode(blob, block_hash)
        seconds.append(time.perf_counter() - start)
    return TierCost(prior.latency_s, prior.seconds_per_byte + min(seconds) / len(blob), len(blob))


def probe_codecs(
    tier: Tier,
    codec: Codec,
    modes: Sequence[str],
    dtype: str,
    array: np.ndarray,
    prior: TierCost,
) -> tuple[Codec, TierCost] | None:
    """Probe `tier` with each codec mode (`probe_tier`) and return the codec whose fetch of a
    typical prefix reads and decodes fastest, with its measured cost; None when the tier refused
    every probe.

    Whole fetches are compared, not bytes: compression makes a block smaller but its decode
    slower, so it pays only on a tier slower than the decode.
    """
    measured: dict[str, TierCost] = {}
    for mode in modes:
        cost = probe_tier(tier, codec.with_mode(mode), dtype, array, prior)
        if cost is not prior:
            measured[mode] = cost
    if not measured:
        return None
    best = min(measured, key=lambda m: measured[m].fetch_s(_TYPICAL_FETCH_BLOCKS))
    return codec.with_mode(best), measured[best]
