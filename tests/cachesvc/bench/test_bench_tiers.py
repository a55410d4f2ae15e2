"""The tiers benchmark's pure parts: caps around the crossover, the prefix that fits the model,
and the summary that checks the issue's goals (benchmarks are not tests: no model runs here)."""

from __future__ import annotations

import pytest

from cachesvc.bench.tiers.report import TierRow, summarize
from cachesvc.bench.tiers.runner import caps_for, estimate_s, prefix_len, slowest_cap


def row(
    fetch: float | None, split: float | None, recompute: float, chosen_ms: float, **kw: object
) -> TierRow:
    best = min(t for t in (fetch, split, recompute) if t is not None)
    fields: dict = dict(
        context=512,
        tier="dram",
        cap_mbps=10.0,
        cap_multiple=1.0,
        fetch_ms=fetch,
        split_ms=split,
        recompute_ms=recompute,
        chosen_ms=chosen_ms,
        chosen="split",
        predicted_ms=chosen_ms,
        ratio=chosen_ms / best,
    )
    fields.update(kw)
    return TierRow(**fields)


def test_caps_sit_around_the_crossover() -> None:
    caps = caps_for(prefix_bytes=200e6, recompute_s=10.0)  # crossover 20 MB/s
    assert [c.mb_per_s for c in caps] == [None, 80.0, 20.0, 5.0]
    assert [c.multiple for c in caps] == [None, 4.0, 1.0, 0.25]
    slow = slowest_cap(prefix_bytes=200e6, block_bytes=1e6, recompute_s=10.0)
    assert 1e6 / (slow.mb_per_s * 1e6) == pytest.approx(10.0)  # one block reads as long as R
    assert slow.multiple == pytest.approx(1 / 200)


def test_estimate_grows_with_recompute_time_and_rounds() -> None:
    caps = caps_for(200e6, 10.0)
    one = estimate_s(10.0, 0.0, 0.0, caps, num_tiers=3, repeats=1)
    assert estimate_s(20.0, 0.0, 0.0, caps, 3, 1) == pytest.approx(2 * one)
    assert estimate_s(10.0, 0.0, 0.0, caps, 3, 3) == pytest.approx(3 * one)
    assert 10 * 10.0 < one < 25 * 10.0  # ~5 recomputes per tier, and the plain engine's
    # Every request pays the pass after landing (7 per tier and a warm-up, 1 on the plain
    # engine); every engine its start.
    assert estimate_s(10.0, 0.1, 2.0, caps, 3, 1) == pytest.approx(one + 25 * 0.1 + 4 * 2.0)


def test_prefix_leaves_room_for_the_suffix_and_the_token() -> None:
    assert prefix_len(1024, 8192) == 1024
    assert prefix_len(8192, 8192) == 8160  # whole blocks; 16 suffix tokens and one generated
    assert prefix_len(8192, 8192) + 16 + 1 <= 8192


def test_summary_measures_the_goals() -> None:
    device = row(None, None, 1000.0, 100.0, tier="device", chosen="device", ratio=None)
    rows = [
        device,
        row(100.0, 200.0, 1000.0, 104.0),  # fetch far ahead: not a near tie
        row(900.0, 500.0, 1000.0, 520.0),  # near: split 1.8x, choice 1.73x
        row(1500.0, 900.0, 1000.0, 960.0),  # near: split 1.11x only
        row(None, 980.0, 1000.0, 1000.0, chosen="recompute"),  # fetch not measured
    ]
    s = summarize(rows)
    assert s.num_rows == 4  # the device row has no choice to judge
    assert s.max_ratio == pytest.approx(1.0667, rel=1e-3)  # 960 / 900
    assert s.rows_over_goal == 1
    assert s.num_near == 2
    assert s.split_speedup_min == pytest.approx(1000 / 900)
    assert s.chosen_speedup_min == pytest.approx(1000 / 960)
    assert (s.near_split_goal_met, s.near_chosen_goal_met) == (1, 1)
