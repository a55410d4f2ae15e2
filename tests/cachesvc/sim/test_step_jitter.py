"""A live step's spread around its median: measured by the calibration as quantiles of a lone
stream's gaps less their round's median, stored in the profile, and drawn by each simulated
worker once per step from a generator seeded by its name (a replay is the same every time)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from cachesvc.bench.calibrate.live import LiveSamples, terms_from
from cachesvc.bench.calibrate.run import with_live_terms
from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, load_profile
from cachesvc.sim.jitter import StepJitter, quantiles
from cachesvc.sim.loop import ClusterSpec, replay
from cachesvc.sim.seq import SimSeq
from cachesvc.sim.trace import load_trace

# 1 ms a prompt token (whole prompts in one step), 10 ms a decode step.
UNIT = dataclasses.replace(
    load_profile("h100-llama3-8b"),
    prefill=ComputeCost(0.0, 1e-3, 0.0),
    decode=DecodeCost(0.01, 0.0, 0.0),
    max_num_batched_tokens=10**7,
)
# Most steps within a millisecond of the median, one in eight 20 ms late.
SPREAD = (-0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.001, 0.02)

WriteTrace = Callable[[list[tuple[float, int, int, list[int]]]], Path]  # conftest's


def test_quantiles_at_evenly_spaced_probabilities() -> None:
    assert quantiles([3.0, 1.0, 2.0, 5.0, 4.0], 4) == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert quantiles([0.0, 10.0], 4) == (0.0, 2.5, 5.0, 7.5, 10.0), "linear between values"
    assert quantiles([], 4) == ()


def test_draws_follow_the_quantiles_and_repeat_with_the_seed() -> None:
    jitter = StepJitter((0.0, 0.01, 0.1), "w0")
    draws = [jitter.draw() for _ in range(20_000)]
    assert min(draws) >= 0.0 and max(draws) <= 0.1
    # Half the mass between 0 and 10 ms, half between 10 and 100 ms.
    assert statistics.median(draws) == pytest.approx(0.01, rel=0.1)
    assert statistics.fmean(draws) == pytest.approx((0.005 + 0.055) / 2, rel=0.05)
    again = StepJitter((0.0, 0.01, 0.1), "w0")
    assert [again.draw() for _ in range(100)] == draws[:100], "the same seed: the same steps"
    other = StepJitter((0.0, 0.01, 0.1), "w1")
    assert [other.draw() for _ in range(100)] != draws[:100], "each worker draws its own"
    assert StepJitter((), "w0").apply(0.3) == 0.3, "none measured: the median step"
    assert StepJitter((-1.0, -1.0), "w0").apply(0.3) == pytest.approx(0.15), "never below half"


def test_the_calibration_records_the_lone_gaps_spread_at_the_profiles_speed() -> None:
    samples = LiveSamples(
        hops_ms=[(30.0, 20.0)],
        alone_ms=[28.0],
        pair_ms=[48.0],
        together_ms=[42.0],
        engine_one_ms=[20.0],
        engine_pair_ms=[36.0],
        alone_excess_ms=[float(x) for x in range(-4, 61)],  # -4 .. 60 ms
    )
    terms = terms_from(samples)
    assert terms.step_jitter_s[0] == pytest.approx(-0.004)
    assert terms.step_jitter_s[-1] == pytest.approx(0.060)
    assert terms.step_jitter_s[len(terms.step_jitter_s) // 2] == pytest.approx(0.028)
    # The engine stepped twice as slow as the profile says while measured: halved.
    unit = dataclasses.replace(UNIT, decode=DecodeCost(0.01, 0.0, 0.0))
    live = with_live_terms(unit, terms)
    assert live.step_jitter_s[-1] == pytest.approx(0.030)
    assert terms_from(dataclasses.replace(samples, alone_excess_ms=[])).step_jitter_s == ()


def test_the_profile_keeps_its_spread() -> None:
    profile = dataclasses.replace(UNIT, step_jitter_s=SPREAD)
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert profile.slowed(2.0).step_jitter_s == tuple(2 * q for q in SPREAD)
    old = {k: v for k, v in profile.to_json().items() if k != "step_jitter_s"}
    assert CostProfile.from_json(old).step_jitter_s == (), "a profile without one has none"
    with pytest.raises(ValueError, match="ascending"):
        dataclasses.replace(UNIT, step_jitter_s=(0.01, 0.0))


def _stream(write_trace: WriteTrace, profile: CostProfile) -> SimSeq:
    requests = load_trace(write_trace([(0, 100, 200, [1])]))
    [seq] = replay(requests, profile, ClusterSpec(1, device_blocks=64), "round_robin").seqs
    return seq


def _gaps(seq: SimSeq) -> list[float]:
    return [b - a for a, b in zip(seq.token_times, seq.token_times[1:], strict=False)]


def test_a_replay_spreads_its_gaps_as_measured_and_the_same_every_time(
    write_trace: WriteTrace,
) -> None:
    steady = _gaps(_stream(write_trace, UNIT))
    assert max(steady) == pytest.approx(min(steady)), "without a spread every gap is the median"
    spread = dataclasses.replace(UNIT, step_jitter_s=SPREAD)
    gaps = _gaps(_stream(write_trace, spread))
    assert gaps == _gaps(_stream(write_trace, spread)), "deterministic"
    assert statistics.median(gaps) == pytest.approx(0.01, abs=0.001)
    late = sum(g > 0.015 for g in gaps) / len(gaps)
    assert 0.02 < late < 0.15, "about the share of late steps the quantiles hold"
    assert max(gaps) <= 0.01 + 0.02 + 1e-9
