"""Fetch or recompute: a pure cost model and the per-request `LoadPlan` it chooses.

A request's first `first_block` blocks are on the device; the lower tiers hold runs of the next
ones (`TierHit`s). Three ways to get their KV, and the plan picks the fastest predicted one:

* fetch: read the runs, then compute the rest of the prompt;
* recompute: compute everything after the device prefix;
* split (Cake, arXiv 2410.03065): recompute blocks [first, m) from the front while fetching
  [m, end) from the back, so both finish together; then compute the rest.

The fetched range may also stop early (`end` before the last hit): a tier slower than
recomputing its blocks is bypassed. Times are predicted as

    read(tier, n)    = latency + n * bytes_per_block * seconds_per_byte        (per tier run)
    land(n)          = n * land_per_block                 (the copy into the device caches)
    compute(k, ctx)  = alpha + beta * k + gamma * k * (ctx + k / 2)            (k new tokens)
    fetch(end)       = read(first..end) + land(first..end) + compute(rest | ctx = end)
    split(m, end)    = max(compute(front), read(m..end)) + overlap(m..end) + land(m..end)
                       + compute(rest | ctx = end)
    overlap(tier, n) = n * bytes_per_block * background_s_per_byte[tier]

A split overlaps the read of the back with the compute of the front, not the landing: the
engine's thread copies the back in once the front is computed. The two share the machine (a
decode thread, a Redis server on the same host), so the overlap ends later than the slower of
the two alone: that delay, per byte read in the background, is learned per tier from the splits
that ran (`overlap_s` of a plan is the part predicted without it).

The coefficients come from a calibration at start, updated online (`cachesvc.kv.calibration`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cachesvc.kv.tiers.results import TierHit

PlanKind = Literal["none", "fetch", "split", "recompute"]
PLAN_MODES = ("auto", "fetch", "split", "recompute")
# A split must be predicted this much faster than fetching the same blocks whole: its prediction
# carries the overlap's uncertainty (a background read sharing the cores with the compute), so
# in a near tie the plain fetch is the safer choice.
SPLIT_MARGIN = 0.05


@dataclass(frozen=True)
class TierCost:
    """Predicted read time of one tier: a fixed latency per batch, then per stored byte."""

    latency_s: float
    seconds_per_byte: float
    bytes_per_block: float  # stored bytes of one block (after this tier's compression)

    def fetch_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.bytes_per_block * self.seconds_per_byte


@dataclass(frozen=True)
class ComputeCost:
    """Predicted prefill time of `k` new tokens after `ctx` cached ones."""

    alpha_s: float
    beta_s: float
    gamma_s: float

    def prefill_s(self, num_tokens: int, context: int) -> float:
        if num_tokens <= 0:
            return 0.0
        k = num_tokens
        return self.alpha_s + self.beta_s * k + self.gamma_s * k * (context + k / 2)


@dataclass(frozen=True)
class CostModel:
    compute: ComputeCost
    tiers: Mapping[str, TierCost]  # read costs, caps included
    land_s_per_block: float = 0.0  # copying one fetched block into the device caches
    # Extra seconds per stored byte of a tier's read in the background of a split's compute.
    background_s_per_byte: Mapping[str, float] = field(default_factory=dict)

    def land_s(self, num_blocks: int) -> float:
        return max(num_blocks, 0) * self.land_s_per_block


@dataclass(frozen=True)
class FetchRange:
    """Blocks [start, end) of the request (absolute block indices) read from `tier`."""

    tier: str
    start: int
    end: int


@dataclass(frozen=True)
class LoadPlan:
    """What to do with the blocks after the device prefix.

    Recompute [first_block, split_block), fetch `fetch` (which covers [split_block, fetch_end)),
    then compute the rest of the prompt. The predicted times of the alternatives are kept, for
    decision traces and the benchmark's "chosen vs best" ratio.
    """

    kind: PlanKind
    first_block: int
    split_block: int
    fetch_end: int
    fetch: tuple[FetchRange, ...]
    predicted_s: float
    fetch_only_s: float
    recompute_only_s: float
    best_split_s: float
    bypassed: tuple[str, ...] = ()
    overlap_s: float = 0.0  # a split's max(front compute, back read), without the overlap delay

    @property
    def num_fetch_blocks(self) -> int:
        return self.fetch_end - self.split_block

    @property
    def num_recompute_blocks(self) -> int:
        return self.split_block - self.first_block


def _read_s(runs: Sequence[TierHit], model: CostModel, start: int, end: int) -> float:
    """Predicted read time of blocks [start, end) from the tiers holding them."""
    total = 0.0
    for run in runs:
        n = min(run.end, end) - max(run.start, start)
        if n > 0:
            total += model.tiers[run.tier].fetch_s(n)
    return total


def _overlap_delay_s(runs: Sequence[TierHit], model: CostModel, start: int, end: int) -> float:
    """What reading blocks [start, end) while the engine computes delays the pair."""
    total = 0.0
    for run in runs:
        n = min(run.end, end) - max(run.start, start)
        if n > 0:
            per_byte = max(model.background_s_per_byte.get(run.tier, 0.0), 0.0)
            total += n * model.tiers[run.tier].bytes_per_block * per_byte
    return total


def _ranges(runs: Sequence[TierHit], start: int, end: int) -> tuple[FetchRange, ...]:
    out = []
    for run in runs:
        lo, hi = max(run.start, start), min(run.end, end)
        if hi > lo:
            out.append(FetchRange(run.tier, lo, hi))
    return tuple(out)


@dataclass(frozen=True)
class _Option:
    seconds: float
    split: int
    end: int
    overlap_s: float = 0.0


def _best(
    runs: Sequence[TierHit],
    first: int,
    num_tokens: int,
    block_size: int,
    model: CostModel,
    strict_split: bool,
) -> _Option | None:
    """The fastest (split, end) with a non-empty fetch; `strict_split` needs recompute too."""
    c = model.compute
    best: _Option | None = None
    for end in sorted({r.end for r in runs}, reverse=True):
        rest = c.prefill_s(num_tokens - end * block_size, end * block_size)
        for split in range(first, end):
            if strict_split and split == first:
                continue
            front = c.prefill_s((split - first) * block_size, first * block_size)
            back = _read_s(runs, model, split, end)
            delay = _overlap_delay_s(runs, model, split, end) if split > first else 0.0
            t = max(front, back) + delay + model.land_s(end - split) + rest
            if best is None or t < best.seconds:
                best = _Option(t, split, end, max(front, back))
    return best


def _fetch_whole(
    runs: Sequence[TierHit],
    first: int,
    end: int,
    num_tokens: int,
    block_size: int,
    model: CostModel,
) -> _Option:
    """Fetching blocks [first, end) with nothing recomputed, then computing the rest."""
    rest = model.compute.prefill_s(num_tokens - end * block_size, end * block_size)
    return _Option(_read_s(runs, model, first, end) + model.land_s(end - first) + rest, first, end)


def plan_load(
    runs: Sequence[TierHit],
    first_block: int,
    num_tokens: int,
    block_size: int,
    model: CostModel,
    mode: str = "auto",
) -> LoadPlan:
    """Choose the plan for a request of `num_tokens` whose first `first_block` blocks are on the
    device and whose next blocks lie in `runs` (absolute block indices, contiguous from
    `first_block`, ending before the block of the last token). Pure."""
    if mode not in PLAN_MODES:
        raise ValueError(f"plan mode must be one of {PLAN_MODES}, got {mode!r}")
    d = first_block
    recompute_s = model.compute.prefill_s(num_tokens - d * block_size, d * block_size)
    if not runs:
        return LoadPlan("none", d, d, d, (), recompute_s, recompute_s, recompute_s, recompute_s)
    full_end = runs[-1].end
    fetch_only = (
        _read_s(runs, model, d, full_end)
        + model.land_s(full_end - d)
        + model.compute.prefill_s(num_tokens - full_end * block_size, full_end * block_size)
    )
    split = _best(runs, d, num_tokens, block_size, model, strict_split=True)
    split_s = split.seconds if split is not None else fetch_only
    choice: _Option | None
    if mode == "recompute":
        choice = None
    elif mode == "fetch":
        choice = _Option(fetch_only, d, full_end)
    elif mode == "split":
        choice = split or _Option(fetch_only, d, full_end)
    else:
        choice = _best(runs, d, num_tokens, block_size, model, strict_split=False)
        if choice is not None and choice.split > d:
            whole = _fetch_whole(runs, d, choice.end, num_tokens, block_size, model)
            if whole.seconds <= choice.seconds * (1 + SPLIT_MARGIN):
                choice = whole
        if choice is not None and choice.seconds >= recompute_s:
            choice = None  # fetching anything would be slower than recomputing it all
    times = (fetch_only, recompute_s, split_s)
    if choice is None:
        tiers = tuple(sorted({r.tier for r in runs}))
        return LoadPlan("recompute", d, d, d, (), recompute_s, *times, bypassed=tiers)
    fetch = _ranges(runs, choice.split, choice.end)
    used = {f.tier for f in fetch}
    bypassed = tuple(sorted({r.tier for r in runs} - used))
    kind: PlanKind = "fetch" if choice.split == d else "split"
    overlap = choice.overlap_s if kind == "split" else 0.0
    return LoadPlan(
        kind, d, choice.split, choice.end, fetch, choice.seconds, *times, bypassed, overlap
    )
