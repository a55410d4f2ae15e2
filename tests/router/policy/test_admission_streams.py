"""Admission on the streams (`admit_itl_ms`, `router.policy.admission`,
`router.policy.stream_gaps`): a request that would join or stall the streams of a worker decoding
them slower than the target is refused; a worker without streams, or whose gaps are unknown, never
refuses this way."""

from __future__ import annotations

import pytest

from router.config import ConfigError, RouterConfig
from router.policy.admission import Admission, admission_of, stalls_of, streams_refusal
from router.policy.pd import PDDecision
from router.policy.stream_gaps import MIN_GAPS, RecentGaps


def test_the_mean_gap_is_over_tokens_not_deltas() -> None:
    gaps = RecentGaps(half_life_s=2.0)
    assert gaps.mean_s(0.0) is None, "nothing seen: unknown"
    gaps.observe(0.0, 0.010)
    gaps.observe(0.0, 0.030)
    gaps.observe(0.0, 0.080, num_gaps=4)  # four tokens in one delta share its 80 ms
    assert gaps.mean_s(0.0) == pytest.approx(0.120 / 6)


def test_recent_gaps_outweigh_old_ones_and_stale_ones_are_forgotten() -> None:
    gaps = RecentGaps(half_life_s=1.0)
    for _ in range(10):
        gaps.observe(0.0, 0.200)  # a prompt's long steps
    for _ in range(10):
        gaps.observe(2.0, 0.010)  # two half-lives later, fast again
    # Weights 10 x 0.25 against 10 x 1: (0.5 + 0.1) / 12.5 s a gap.
    assert gaps.mean_s(2.0) == pytest.approx((10 * 0.25 * 0.2 + 10 * 0.01) / 12.5)
    # Silent long enough that fewer than MIN_GAPS of weight are left: unknown again.
    assert gaps.mean_s(2.0 + 3.0) is not None  # 12.5 x 2^-3 left
    assert gaps.mean_s(2.0 + 10.0) is None
    assert MIN_GAPS > 12.5 * 0.5**10


def test_a_gap_needs_a_token_and_a_positive_half_life() -> None:
    gaps = RecentGaps()
    gaps.observe(0.0, 0.5, num_gaps=0)
    gaps.observe(0.0, -1.0)
    assert gaps.mean_s(0.0) is None
    with pytest.raises(ValueError, match="half-life"):
        RecentGaps(half_life_s=0.0)


def test_streams_slower_than_the_target_refuse_more_work() -> None:
    admission = Admission(itl_s=0.040)
    # 30 ms a gap lately, and a 1.2 s prefill spread over a 101-token answer: 42 ms.
    reason = admission.itl_refusal(0.030, 1.2, 101.0, num_streams=3)
    assert reason is not None and "admit_itl_ms 40" in reason and "42.0 ms" in reason
    assert admission.itl_refusal(0.030, 0.8, 101.0, num_streams=3) is None, "38 ms: admitted"
    assert admission.itl_refusal(0.045, 0.0, 101.0, num_streams=1) is not None


def test_no_streams_unknown_gaps_or_no_target_never_refuse() -> None:
    admission = Admission(itl_s=0.040)
    assert admission.itl_refusal(0.500, 9.0, 100.0, num_streams=0) is None
    assert admission.itl_refusal(None, 9.0, 100.0, num_streams=5) is None
    assert Admission(ttft_s=2.0).itl_refusal(0.500, 9.0, 100.0, num_streams=5) is None
    assert Admission(ttft_s=2.0).on and Admission(itl_s=0.1).on and not Admission().on


def test_the_workers_a_decision_touches() -> None:
    kept = PDDecision(False, "", colocated_prefill_s=0.7, disaggregated_prefill_s=0.5)
    assert stalls_of(kept, "w0", "w1", "w2") == [("w0", 0.7)]
    moved = PDDecision(
        True, "", colocated_prefill_s=0.7, disaggregated_prefill_s=0.5, decode_stall_s=0.01
    )
    assert stalls_of(moved, "w0", "w1", "w2") == [("w2", 0.01), ("w1", 0.5)]
    assert stalls_of(moved, "w0", None, None) == [("w0", 0.7)]


def test_the_router_setting_is_in_milliseconds_and_validated() -> None:
    assert admission_of(RouterConfig(admit_itl_ms=40.0)) == Admission(None, 0.040)
    assert admission_of(RouterConfig(admit_ttft_ms=2000.0)) == Admission(2.0, None)
    with pytest.raises(ConfigError, match="admit_itl_ms"):
        RouterConfig(admit_itl_ms=0.0)
    with pytest.raises(ValueError, match="admit_itl_ms"):
        Admission(itl_s=-0.01)


def test_the_first_worker_whose_streams_refuse_is_named() -> None:
    admission = Admission(itl_s=0.040)
    touched = [("w0", 0.010, 0.0, 2), ("w1", None, 0.0, 3), ("w2", 0.050, 0.0, 1)]
    reason = streams_refusal(admission, touched, 100.0)
    assert reason is not None and reason.endswith("(worker w2)")
    assert streams_refusal(admission, touched[:2], 100.0) is None
