"""The live path's terms of a cost profile, as the simulator uses them: the hop adds to a
request's TTFT and nothing to its gaps, the worker's overhead to every step, contention to steps
taken while another worker steps; the terms are read from a profile and derived from the live
measurements as `cachesvc simulate calibrate` derives them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cachesvc.bench.calibrate.live import LiveSamples, prefill_overhead, split_overhead, terms_from
from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost
from cachesvc.sim.loop import ClusterSpec, SimRun, replay
from cachesvc.sim.seq import SimSeq
from cachesvc.sim.trace import load_trace

# A millisecond per prompt token, 10 ms per decode step: whole prompts in one step.
UNIT = CostProfile(
    name="unit",
    description="test clock",
    kv_bytes_per_token=1.0,
    prefill=ComputeCost(alpha_s=0.0, beta_s=1e-3, gamma_s=0.0),
    decode=DecodeCost(base_s=0.01, per_seq_s=0.0, per_context_token_s=0.0),
    max_num_batched_tokens=10**7,
    max_num_seqs=10**4,
)
SPEC = ClusterSpec(2, device_blocks=64)
PROMPT = 100  # tokens: 0.1 s of prefill (requests of other hash ids share nothing)

WriteTrace = Callable[[list[tuple[float, int, int, list[int]]]], Path]  # conftest's


def _one_request(write_trace: WriteTrace, profile: CostProfile, output_len: int = 4) -> SimSeq:
    requests = load_trace(write_trace([(0, PROMPT, output_len, [1])]))
    [seq] = replay(requests, profile, SPEC, "round_robin").seqs
    return seq


def _gaps(seq: SimSeq) -> list[float]:
    return [b - a for a, b in zip(seq.token_times, seq.token_times[1:], strict=False)]


def test_the_hop_adds_to_the_ttft_of_a_request_on_an_idle_worker(write_trace: WriteTrace) -> None:
    plain = _one_request(write_trace, UNIT)
    hopped = _one_request(write_trace, dataclasses.replace(UNIT, hop_s=0.03))
    assert plain.first_token_s == pytest.approx(0.1)
    assert hopped.first_token_s == pytest.approx(0.1 + 0.03), "the client sees it a hop later"
    assert _gaps(hopped) == pytest.approx(_gaps(plain)), "every token travels the same hop"
    assert hopped.finish_s == plain.finish_s, "the worker is not busy any longer"


def test_the_step_overhead_lengthens_every_step(write_trace: WriteTrace) -> None:
    seq = _one_request(write_trace, dataclasses.replace(UNIT, step_overhead_s=0.005))
    assert seq.first_token_s == pytest.approx(0.1 + 0.005)
    assert _gaps(seq) == pytest.approx([0.01 + 0.005] * 3)


def test_a_live_worker_computes_prompts_slower_and_decodes_as_the_engine(
    write_trace: WriteTrace,
) -> None:
    seq = _one_request(write_trace, dataclasses.replace(UNIT, prefill_overhead_s=0.02))
    assert seq.first_token_s == pytest.approx(0.1 + 0.02)
    assert _gaps(seq) == pytest.approx([0.01] * 3)


def _two_workers(write_trace: WriteTrace, profile: CostProfile) -> SimRun:
    # Round robin: a long decode on w0 from 0 s; a short request on w1 from 0.5 s.
    rows = [(0, PROMPT, 200, [1]), (500, PROMPT, 4, [2])]
    return replay(load_trace(write_trace(rows)), profile, SPEC, "round_robin")


def test_contention_slows_the_steps_taken_while_another_worker_steps(
    write_trace: WriteTrace,
) -> None:
    shared = dataclasses.replace(UNIT, contention=0.5)
    short = next(s for s in _two_workers(write_trace, shared).seqs if s.req.index == 1)
    assert short.first_token_s - short.req.arrival_s == pytest.approx(0.1 * 1.5)
    assert _gaps(short) == pytest.approx([0.01 * 1.5] * 3)
    # The long decode ran alone for its first half second (no contention before the other).
    alone = _one_request(write_trace, shared)
    assert _gaps(alone) == pytest.approx([0.01] * 3), "no other worker steps: no contention"
    # Without contention both workers step at the profile's speed.
    plain = next(s for s in _two_workers(write_trace, UNIT).seqs if s.req.index == 1)
    assert _gaps(plain) == pytest.approx([0.01] * 3)


def test_the_live_terms_are_read_checked_and_scaled(tmp_path: Path) -> None:
    live = dataclasses.replace(UNIT, hop_s=0.01, step_overhead_s=0.002, contention=0.4)
    assert CostProfile.from_json(json.loads(json.dumps(live.to_json()))) == live
    old = {k: v for k, v in UNIT.to_json().items() if k not in ("hop_s", "contention")}
    assert CostProfile.from_json(old).hop_s == 0.0, "a profile without them has none"
    with pytest.raises(ValueError, match="live path"):
        dataclasses.replace(UNIT, contention=-0.1)
    slow = live.slowed(2.0)
    assert slow.step_s([(10, 5)], [7]) == pytest.approx(2 * live.step_s([(10, 5)], [7]))
    assert (slow.hop_s, slow.contention) == (0.02, 0.4), "contention is a ratio: unchanged"
    assert live.step_s([], [7], others_stepping=1) == pytest.approx(1.4 * live.step_s([], [7]))
    assert live.engine_step_s([], [7]) == pytest.approx(0.01), "the engine's own step"


def test_the_terms_come_from_the_live_medians() -> None:
    samples = LiveSamples(
        # Client and worker TTFTs of one-token requests: the hop is their median difference.
        hops_ms=[(110.0, 100.0), (130.0, 118.0), (95.0, 90.0)],
        alone_ms=[14.0, 15.0, 16.0],  # the engine steps one sequence in 10 ms: 5 ms more
        pair_ms=[27.0],  # it steps two in 20 ms: 7 ms more, so 2 ms a sequence, 3 ms a step
        together_ms=[21.0],
        engine_one_ms=[9.0, 10.0, 30.0],
        engine_pair_ms=[20.0],
    )
    terms = terms_from(samples)
    assert terms.hop_s == pytest.approx(0.010)
    assert terms.token_overhead_s == pytest.approx(0.002)
    assert terms.step_overhead_s == pytest.approx(0.003)
    assert terms.contention == pytest.approx(21.0 / 15.0 - 1)
    # A machine that stepped slower here than in the workers gives no negative overhead, nor
    # two streams faster than one a negative contention.
    fast = terms_from(dataclasses.replace(samples, alone_ms=[8.0], together_ms=[7.0]))
    assert (fast.step_overhead_s, fast.contention) == (0.0, 0.0)
    # Noise that leaves no exact split >= 0: the least-squares one that is.
    assert split_overhead(3.0, 15.0) == pytest.approx((0.0, (3.0 + 30.0) / 5))
    assert split_overhead(6.0, 4.0) == pytest.approx((5.0, 0.0))
    # Rounds' own ratios, where measured: one round disturbed by other work moves none.
    rounds = dataclasses.replace(samples, together_ratios=[1.2, 1.9, 1.3])
    assert terms_from(rounds).contention == pytest.approx(0.3)
    # A short request's 70 ms on the worker is 15 ms more than the engine's 50 ms and the
    # 3 + 2 ms of overheads; at one size the extra is all constant.
    assert terms_from(samples).prefill_overhead_s == 0.0, "none measured: none assumed"
    prefills = dataclasses.replace(samples, prefills_ms=[(64, 70.0, 50.0), (64, 80.0, 60.0)])
    assert terms_from(prefills).prefill_overhead_s == pytest.approx(0.015)
    assert terms_from(prefills).prefill_overhead_share == 0.0


def test_a_live_prefill_extra_that_grows_with_the_step_is_a_share_of_it() -> None:
    # The worker takes 10 ms and 20% more than the engine's step at each size (after the
    # 5 ms of overheads), with one noisy sample a size that the medians leave out.
    steps = {16: 100.0, 64: 250.0, 128: 450.0}
    samples = [(n, 5.0 + 10.0 + 1.2 * e, e) for n, e in steps.items() for _ in range(2)]
    samples += [(n, 5.0 * e, e) for n, e in steps.items()]
    assert prefill_overhead(samples, 5.0) == pytest.approx((10.0, 0.2))
    # An extra that does not grow: a constant; one that would need a negative constant: a
    # share through the origin.
    flat = [(n, 5.0 + 30.0 + e, e) for n, e in steps.items()]
    assert prefill_overhead(flat, 5.0) == pytest.approx((30.0, 0.0))
    shrinking = [(n, 5.0 + 40.0 - 0.05 * e + e, e) for n, e in steps.items()]
    assert prefill_overhead(shrinking, 5.0)[1] == 0.0
    proportional = [(n, 5.0 + 1.3 * e - 8.0, e) for n, e in steps.items()]
    constant, share = prefill_overhead(proportional, 5.0)
    assert constant == 0.0 and 0.2 < share < 0.3
    assert prefill_overhead([], 5.0) == (0.0, 0.0)


def test_the_share_lengthens_a_prefill_step_and_no_decode_step(write_trace: WriteTrace) -> None:
    profile = dataclasses.replace(UNIT, prefill_overhead_share=0.5, prefill_overhead_s=0.01)
    seq = _one_request(write_trace, profile)
    assert seq.first_token_s == pytest.approx(0.1 * 1.5 + 0.01)
    assert _gaps(seq) == pytest.approx([0.01] * 3)
    assert profile.slowed(2.0).prefill_overhead_share == 0.5, "a ratio: the same at any speed"
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_live_terms_measured_on_a_busy_machine_are_brought_to_the_profiles_speed() -> None:
    from cachesvc.bench.calibrate.run import with_live_terms

    # The engine stepped one sequence in 20 ms while the terms were measured; the profile says
    # 10 ms: the machine was twice as slow, so its hop and overheads count half.
    samples = LiveSamples([(30.0, 20.0)], [28.0], [48.0], [42.0], [20.0], [36.0])
    live = with_live_terms(UNIT, terms_from(samples))
    assert (live.hop_s, live.step_overhead_s, live.token_overhead_s) == pytest.approx(
        (0.005, 0.002, 0.002)
    )
    assert live.contention == pytest.approx(0.5), "a ratio: the same at any speed"
    assert live.prefill == UNIT.prefill and live.decode == UNIT.decode


def test_a_measured_batch_table_replaces_the_linear_decode_cost() -> None:
    # Two sequences step slower than four, as this machine's CPU kernels do.
    table = DecodeCost(0.05, 0.01, 1e-6, by_batch_s=(0.07, 0.12, 0.14, 0.09))
    assert table.step_s(2, 100) == pytest.approx(0.12 + 1e-4)
    assert table.step_s(4, 0) == pytest.approx(0.09)
    assert table.step_s(6, 0) == pytest.approx(0.05 + 0.06), "beyond the table: linear"
    profile = dataclasses.replace(UNIT, decode=table, token_overhead_s=0.001)
    assert profile.step_s([], [10, 10]) == pytest.approx(0.12 + 2e-5 + 0.002)
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    with pytest.raises(ValueError, match="by_batch"):
        CostProfile.from_json({**profile.to_json(), "decode": {"by_batch": [1.0]}})


def test_the_prefill_fit_keeps_short_prompts_right() -> None:
    from cachesvc.bench.calibrate.run import PREFILL_SHAPES, fit_prefill
    from cachesvc.kv.calibration import ComputeSample

    truth = ComputeCost(alpha_s=0.1, beta_s=3e-3, gamma_s=1e-6)
    samples = [ComputeSample.of([s], truth.prefill_s(*s)) for s in PREFILL_SHAPES]
    # The longest step 10% slow (a busy moment): short steps, mostly fixed cost, stay right.
    longest = max(range(len(samples)), key=lambda i: samples[i].seconds)
    samples[longest] = ComputeSample.of([PREFILL_SHAPES[longest]], samples[longest].seconds * 1.1)
    fitted = fit_prefill(samples)
    for k, ctx in PREFILL_SHAPES[:3]:
        assert fitted.prefill_s(k, ctx) == pytest.approx(truth.prefill_s(k, ctx), rel=0.05)
