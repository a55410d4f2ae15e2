"""What `cachesvc bench tiers` reports: its rows (tiers, DRAM bandwidth, codec), the summary
that checks the issue's goals, and the printed tables."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from cachesvc.workloads.table import format_table

NEAR_TIE = 2.0  # fetch and recompute within this factor of each other: split should pay most
SPLIT_GOAL = 1.3  # ... there, split (and the choice) this much faster than both
RATIO_GOAL = 1.05  # the choice at most this much slower than the best alternative


@dataclass(frozen=True)
class TierRow:
    """TTFT in ms of each plan with the prefix in `tier` ("device": already on the device)."""

    context: int
    tier: str
    cap_mbps: float | None
    cap_multiple: float | None  # the cap over the context's crossover bandwidth
    fetch_ms: float | None  # None: not measured (see `skipped`)
    split_ms: float | None
    recompute_ms: float  # on this row's engine (the device row: on a plain engine)
    chosen_ms: float
    chosen: str  # the planner's plan kind ("device" for the device row)
    predicted_ms: float | None  # what the planner expected of its choice
    ratio: float | None  # chosen over the best measured alternative; None for the device row
    predicted: dict[str, float] = field(default_factory=dict)  # ms of each plan, predicted
    skipped: dict[str, str] = field(default_factory=dict)  # forced mode -> why not measured
    same_as_chosen: str | None = None  # the plan whose time is the choice's own run


@dataclass(frozen=True)
class BandwidthRow:
    """A whole-prefix fetch from DRAM (uncapped) next to a plain copy of as many bytes."""

    context: int
    num_bytes: int
    read_ms: float  # tier get + decode (checksum)
    land_ms: float  # the copy into the device caches
    fetch_gb_s: float
    memcpy_gb_s: float  # torch copy_ between preallocated tensors
    numpy_gb_s: float  # numpy copyto between the same buffers
    ratio: float  # fetch over torch copy_
    ratio_numpy: float


@dataclass(frozen=True)
class CodecRow:
    dtype: str
    mode: str
    ratio: float
    encode_mb_s: float
    decode_mb_s: float


@dataclass(frozen=True)
class Summary:
    """The issue's goals, measured: the choice vs the best alternative everywhere; and where
    fetch and recompute are within `NEAR_TIE` of each other, split and the choice vs both."""

    num_rows: int
    max_ratio: float
    rows_over_goal: int  # ratio above RATIO_GOAL
    num_near: int
    split_speedup_min: float | None  # min over near rows of min(fetch, recompute) / split
    chosen_speedup_min: float | None
    near_split_goal_met: int  # near rows where split is SPLIT_GOAL faster than both
    near_chosen_goal_met: int
    prediction_error_median: float  # |predicted / measured - 1| of the choice


def summarize(rows: list[TierRow]) -> Summary:
    planned = [r for r in rows if r.ratio is not None]
    ratios = [r.ratio for r in planned if r.ratio is not None]
    near = [(r, pure) for r in planned if (pure := _near_tie(r)) is not None]
    split_speedups = [pure / r.split_ms for r, pure in near if r.split_ms is not None]
    chosen_speedups = [pure / r.chosen_ms for r, pure in near]
    errors = [abs(r.predicted_ms / r.chosen_ms - 1) for r in planned if r.predicted_ms is not None]
    return Summary(
        len(planned),
        max(ratios, default=0.0),
        sum(r > RATIO_GOAL for r in ratios),
        len(near),
        min(split_speedups, default=None),
        min(chosen_speedups, default=None),
        sum(s >= SPLIT_GOAL for s in split_speedups),
        sum(s >= SPLIT_GOAL for s in chosen_speedups),
        statistics.median(errors) if errors else 0.0,
    )


def _near_tie(r: TierRow) -> float | None:
    """The better pure plan's time, when fetch and recompute are within `NEAR_TIE`."""
    if r.fetch_ms is None:
        return None
    lo, hi = sorted((r.fetch_ms, r.recompute_ms))
    return lo if hi <= NEAR_TIE * lo else None


def print_report(
    rows: list[TierRow], bandwidth: list[BandwidthRow], codec: list[CodecRow], header: str
) -> Summary:
    print(f"\n{header}; TTFT in ms")
    headers = ["context", "tier", "cap MB/s", "x cross", "fetch", "split", "recompute"]
    headers += ["chosen", "plan", "predicted", "ratio"]
    print(format_table(headers, [_cells(r) for r in rows]))
    skipped = sorted({why for r in rows for why in r.skipped.values()})
    if skipped:
        print(f"-: not measured ({'; '.join(skipped)})")
    print("the forced plan that is the choice's own plan was not rerun: its time is the choice's")
    summary = summarize(rows)
    _print_summary(summary)
    print("\nDRAM fetch of the whole prefix vs a plain copy of as many bytes (single thread)")
    print(
        format_table(
            ["context", "MB", "read ms", "land ms", "fetch GB/s", "copy_ GB/s", "ratio"]
            + ["numpy GB/s", "ratio"],
            [
                [b.context, b.num_bytes / 1e6, b.read_ms, b.land_ms, b.fetch_gb_s]
                + [b.memcpy_gb_s, b.ratio, b.numpy_gb_s, b.ratio_numpy]
                for b in bandwidth
            ],
        )
    )
    print("\ncodec on the real KV of the prefix (single thread)")
    print(
        format_table(
            ["dtype", "mode", "ratio", "encode MB/s", "decode MB/s"],
            [[c.dtype, c.mode, c.ratio, c.encode_mb_s, c.decode_mb_s] for c in codec],
        )
    )
    return summary


def _cells(r: TierRow) -> list[Any]:
    cap = "-" if r.cap_mbps is None else r.cap_mbps
    multiple = "-" if r.cap_multiple is None else r.cap_multiple
    return [
        r.context,
        r.tier,
        cap,
        multiple,
        "-" if r.fetch_ms is None else r.fetch_ms,
        "-" if r.split_ms is None else r.split_ms,
        r.recompute_ms,
        r.chosen_ms,
        r.chosen,
        "-" if r.predicted_ms is None else r.predicted_ms,
        "-" if r.ratio is None else r.ratio,
    ]


def _print_summary(s: Summary) -> None:
    print(
        f"\nchoice vs best alternative: max ratio {s.max_ratio:.3f}, {s.rows_over_goal} of "
        f"{s.num_rows} rows over {RATIO_GOAL} (goal: none); predictions off by "
        f"{s.prediction_error_median:.1%} (median)"
    )
    if s.num_near == 0:
        print(f"no row with fetch and recompute within {NEAR_TIE:g}x of each other")
        return
    split = "-" if s.split_speedup_min is None else f"{s.split_speedup_min:.2f}x"
    chosen = "-" if s.chosen_speedup_min is None else f"{s.chosen_speedup_min:.2f}x"
    print(
        f"{s.num_near} rows with fetch and recompute within {NEAR_TIE:g}x: split faster than "
        f"both by at least {split} ({s.near_split_goal_met} at >= {SPLIT_GOAL}x), the choice "
        f"by {chosen} ({s.near_chosen_goal_met} at >= {SPLIT_GOAL}x)"
    )
