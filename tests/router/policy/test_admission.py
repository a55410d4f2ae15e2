"""Admission (`router.policy.admission`): a request predicted to start later than `admit_ttft_ms` is
refused with a reason that names the setting; none is refused without it."""

from __future__ import annotations

import pytest

from router.config import ConfigError, RouterConfig
from router.policy.admission import Admission, CalibratedAdmission, TTFTScale, predicted_ttft_s


def test_the_prediction_is_the_queue_and_the_prompt_at_the_workers_speed() -> None:
    # 300 tokens queued and 100 of its own at 2 ms a token.
    assert predicted_ttft_s(300, 100, 2e-3) == pytest.approx(0.8)
    assert predicted_ttft_s(0, 0, 2e-3) == 0.0


def test_a_request_predicted_later_than_the_target_is_refused() -> None:
    admission = Admission(1.5)
    assert admission.refusal(1.5, 1.0) is None, "at the target it is admitted"
    assert admission.refusal(0.2, 0.1) is None
    reason = admission.refusal(2.25, 1.0)
    assert reason is not None
    assert "admit_ttft_ms 1500 ms" in reason and "2250 ms" in reason


def test_without_a_target_nothing_is_refused() -> None:
    assert Admission().refusal(1e9, 1e9) is None


def test_nothing_queued_ahead_is_always_admitted() -> None:
    # A prompt alone on its worker that takes longer than the target: refusing it would
    # protect no queue, and the scale learns only from requests admitted.
    assert Admission(1.5).refusal(9.0, 0.0) is None
    assert Admission(1.5).refusal(9.0, 0.001) is not None


@pytest.mark.parametrize("bad", [0.0, -5.0])
def test_a_target_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="admit_ttft_ms"):
        Admission(bad / 1e3)
    with pytest.raises(ConfigError, match="admit_ttft_ms"):
        RouterConfig(admit_ttft_ms=bad)


def test_the_scale_is_measured_over_predicted_seconds_of_recent_requests() -> None:
    scale = TTFTScale()
    assert scale.factor == 1.0, "nothing measured yet: the prediction as it is"
    scale.observe(0.5, 1.0)
    assert scale.factor == pytest.approx(2.0), "the first measurement sets it"
    for _ in range(200):
        scale.observe(1.0, 3.0)
    assert scale.factor == pytest.approx(3.0, rel=1e-3), "recent requests weigh most"


def test_a_cached_prompts_tiny_prediction_does_not_swing_the_scale() -> None:
    # A ratio of sums: 2 ms predicted, 30 ms measured (the hop) barely moves a scale of 1.5
    # learnt on second-long prompts; a mean of ratios would jump toward 15.
    scale = TTFTScale()
    for _ in range(50):
        scale.observe(1.0, 1.5)
    scale.observe(0.002, 0.030)
    assert scale.factor == pytest.approx(1.5, rel=0.02)
    scale.observe(0.0, 5.0)  # nothing to scale: ignored
    assert scale.factor == pytest.approx(1.5, rel=0.02)


def test_calibrated_admission_refuses_on_the_scaled_prediction() -> None:
    admission = CalibratedAdmission(Admission(1.5))
    assert admission.refusal(1.0, 0.5) is None
    admission.scale.observe(1.0, 2.0)  # requests take twice what is predicted
    reason = admission.refusal(1.0, 0.5)
    assert reason is not None and "2000 ms" in reason


def test_a_workers_prefill_speed_is_its_reported_cost_or_an_h100s() -> None:
    from router.policy.costs import UNREPORTED_S_PER_TOKEN, prefill_token_s
    from workers.protocol import BlockCosts

    assert prefill_token_s(BlockCosts(compute_s=0.032, fetch_s={}), 16) == pytest.approx(2e-3)
    assert prefill_token_s(None, 16) == UNREPORTED_S_PER_TOKEN
    assert prefill_token_s(BlockCosts(compute_s=0.0, fetch_s={}), 16) == UNREPORTED_S_PER_TOKEN
