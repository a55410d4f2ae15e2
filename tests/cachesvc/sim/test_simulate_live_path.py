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

from cachesvc.planner import ComputeCost
from cachesvc.sim.calibrate_live import STREAM_PROMPT_LEN, STREAM_TOKENS, terms_from
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
    # Client and worker TTFTs of one-token requests (ms): the hop is their median difference.
    hops = [(110.0, 100.0), (130.0, 118.0), (95.0, 90.0)]
    context = STREAM_PROMPT_LEN + STREAM_TOKENS // 2
    engine_ms = UNIT.engine_step_s([], [context]) * 1e3  # 10 ms
    terms = terms_from(UNIT, hops, gaps_alone_ms=[14.0, 15.0, 16.0], gaps_together_ms=[21.0])
    assert terms.hop_s == pytest.approx(0.010)
    assert terms.step_overhead_s == pytest.approx((15.0 - engine_ms) / 1e3)
    assert terms.contention == pytest.approx(21.0 / 15.0 - 1)
    # A machine faster than its profile has no negative overhead, nor negative contention.
    fast = terms_from(UNIT, hops, gaps_alone_ms=[8.0], gaps_together_ms=[7.0])
    assert (fast.step_overhead_s, fast.contention) == (0.0, 0.0)
