"""`cachesvc simulate --like-bench-pd` on the bench's two setups, and the figures `cachesvc bench
sim-agreement` compares: each live run kept, judged on their median, hit ratios by difference
and latencies relative to it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cachesvc.bench.agreement_report import (
    HIT_RATIO,
    Figure,
    format_figures,
    pd_figures,
    routing_figures,
)
from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, TierReadCost, save_profile
from cachesvc.sim.like_bench_pd import replay_bench_pd
from cachesvc.sim.report import SimSummary
from cachesvc.workloads.pd import ALONE, SETUPS, WITH_PROMPTS, PDShape, PhaseResult
from cachesvc.workloads.routing_report import PolicyResult

# Slow enough that the quick bench's decodes (64 tokens at 60 ms) still run when its first long
# prompt (1024 tokens at 2 ms) arrives at 3 s; pulls cost a little.
SLOW = CostProfile(
    name="slow",
    description="test clock",
    kv_bytes_per_token=1000.0,
    prefill=ComputeCost(alpha_s=0.0, beta_s=2e-3, gamma_s=0.0),
    decode=DecodeCost(base_s=0.06, per_seq_s=0.0, per_context_token_s=0.0),
    peer=TierReadCost(5e-3, 1e-9),
)


def test_the_bench_pd_replay_keeps_its_setups_and_hands_off_under_running_decodes() -> None:
    shape = PDShape(quick=True)
    results = replay_bench_pd(SLOW, shape)
    assert [(r.setup, r.phase) for r in results] == [
        (setup, phase) for setup in SETUPS for phase in (ALONE, WITH_PROMPTS)
    ]
    for r in results:
        assert len(r.gaps_s) == shape.streams * (shape.decode_tokens - 1)
        assert len(r.ttft_s) == (shape.long_prompts if r.phase == WITH_PROMPTS else 0)
    mixed, paired = results[1], results[3]
    assert mixed.disaggregated == 0, "two mixed workers: no prefill worker to hand off to"
    assert paired.disaggregated >= 1 and paired.kv_moved_tokens >= shape.long_tokens
    # Colocated, a long prompt's prefill stalls a decode stream for its whole prefill (2 s);
    # handed to the prefill worker, it does not.
    assert max(mixed.gaps_s) > 2.0 > max(paired.gaps_s)
    always = replay_bench_pd(SLOW, shape, "always")[3]
    assert always.disaggregated == shape.long_prompts


def test_the_command_line_replays_the_bench_pd(tmp_path: Path) -> None:
    from cachesvc.app.cli.main import main

    profile, out = tmp_path / "slow.json", tmp_path / "out.json"
    save_profile(SLOW, profile)
    args = ["simulate", "--like-bench-pd", "--quick", "--profile", str(profile)]
    assert main([*args, "--json", str(out)]) == 0
    phases = json.loads(out.read_text())
    assert [p["phase"] for p in phases] == [ALONE, WITH_PROMPTS] * 2
    assert main([*args, "--pd", "colocated"]) == 2, "the bench has no colocated-only setup"


def _policy(name: str, hit: float, p50: float, p99: float) -> PolicyResult:
    return PolicyResult(name, "trace", 24, 0, hit, 0, p50, p99, 1.0, 1.0, {})


def _summary(name: str, hit: float, p50: float, p99: float) -> SimSummary:
    return SimSummary(
        name, "", 24, 0, hit, {}, 0.7, hit / 0.7, p50, p99, 1.0, 0, 0.0, 1.0, 0, 1.0, {}, {}, 0.0
    )


def test_routing_figures_are_judged_on_the_live_median() -> None:
    runs = [[_policy("rr", 0.50, 100, 400)], [_policy("rr", 0.52, 300, 500)]]
    runs.append([_policy("rr", 0.51, 200, 900)])
    hit, p50, p99 = routing_figures(runs, [_summary("rr", 0.53, 180, 700)])
    assert (hit.name, hit.live, hit.live_median) == (HIT_RATIO, (0.50, 0.52, 0.51), 0.51)
    assert hit.error == pytest.approx(0.02) and hit.agrees, "hit ratios: within 0.02"
    assert p50.error == pytest.approx(-0.10) and p50.agrees, "180 against a median of 200"
    assert p99.error == pytest.approx(0.40) and not p99.agrees, "700 against 500: 40% over"
    text = format_figures([hit, p50, p99])
    assert "2 of 3 figures agree" in text and "largest latency error 40%" in text


def test_pd_figures_compare_percentiles_of_the_gaps_and_the_long_prompts() -> None:
    live = [
        PhaseResult("2 mixed", ALONE, gaps_s=[0.1] * 10),
        PhaseResult("2 mixed", WITH_PROMPTS, gaps_s=[0.1] * 99 + [3.0], ttft_s=[2.0, 2.4]),
    ]
    simulated = [
        PhaseResult("2 mixed", ALONE, gaps_s=[0.09] * 10),
        PhaseResult("2 mixed", WITH_PROMPTS, gaps_s=[0.1] * 100, ttft_s=[2.0, 2.2]),
    ]
    figures = pd_figures([live, live], simulated)
    names = [(f.row, f.name) for f in figures]
    assert names == [
        ("2 mixed, decodes alone", "ITL p50 ms"),
        ("2 mixed, decodes alone", "ITL p99 ms"),
        ("2 mixed, with long prompts", "ITL p50 ms"),
        ("2 mixed, with long prompts", "ITL p99 ms"),
        ("2 mixed, with long prompts", "long TTFT p50 ms"),
        ("2 mixed, with long prompts", "long TTFT p99 ms"),
    ]
    assert figures[0].error == pytest.approx(-0.1)
    assert not figures[3].agrees, "the simulator misses the stall the live p99 shows"
    slowed = Figure("pd", "r", "ITL p50 ms", (100.0, 120.0), 80.0, at_speed=(105.0, 115.0))
    assert slowed.at_speed_error == pytest.approx(0.0) and not slowed.agrees


def test_recorded_live_runs_are_read_back_with_their_slowdown_against_another_profile(
    tmp_path: Path,
) -> None:
    from cachesvc.bench.agreement import LiveRun, load_runs, runs_to_json

    run = LiveRun(
        [_policy("rr", 0.5, 200, 400)],
        [PhaseResult("2 mixed", ALONE, gaps_s=[0.1, 0.2])],
        load_before=1.5,
        load_after=2.5,
        slowdown=1.2,
    )
    path = tmp_path / "agreement.json"
    path.write_text(json.dumps({"profile": SLOW.to_json(), "runs": runs_to_json([run])}))
    [back] = load_runs(str(path), ["routing", "pd"], SLOW)
    assert back == run
    # Measured 1.2x slower than SLOW: 2.4x slower than a profile twice as fast.
    [faster] = load_runs(str(path), ["pd"], SLOW.slowed(0.5))
    assert faster.slowdown == pytest.approx(2.4)
    path.write_text(
        json.dumps(
            {"profile": SLOW.to_json(), "runs": runs_to_json([LiveRun([], run.pd, 1.0, 1.0, 1.0)])}
        )
    )
    with pytest.raises(ValueError, match="no live routing"):
        load_runs(str(path), ["routing", "pd"], SLOW)


def test_the_committed_cpu_profile_carries_the_live_path() -> None:
    from cachesvc.sim.cost_profile import load_profile

    # Without the live path the simulator was 1.4-1.6x below the live workers' own TTFT: a
    # profile of the engine alone must not replace it.
    cpu = load_profile("cpu-calibrated")
    assert cpu.hop_s > 0 and cpu.contention > 0
    assert cpu.prefill_overhead_s + cpu.prefill_overhead_share > 0
    assert cpu.step_overhead_s + cpu.token_overhead_s > 0
    assert len(cpu.decode.by_batch_s) == 8, "small batches measured, not extrapolated"
    # A client sees a one-token request of a 64-token prompt after the engine's prefill step,
    # the live worker's extra, and a hop: more than the engine alone takes.
    engine_s = cpu.engine_step_s([(64, 0)], [])
    assert cpu.step_s([(64, 0)], []) + cpu.hop_s > engine_s


def test_the_bench_pd_replay_spreads_the_decode_streams_as_the_live_router_does() -> None:
    # Two sequences step twice as long as one: where the two streams run shows in their gaps.
    paired = dataclasses.replace(SLOW, decode=DecodeCost(0.06, 0.0, 0.0, by_batch_s=(0.06, 0.12)))
    mixed_alone = replay_bench_pd(paired, PDShape(quick=True))[0]
    # The worker warmed last still looks busy at the router's first decision (a poll late), so
    # the warm-up request's worker is not the only one with busy seconds: one stream each.
    assert max(mixed_alone.gaps_s) == pytest.approx(0.06)


def test_a_policy_polled_late_sees_the_last_warmed_worker_busy_once() -> None:
    """The first decision, chosen and then recorded, sees the worker warmed last with a
    request; the next sees it as it is."""
    from cachesvc.kv.types import WorkerId
    from cachesvc.sim.like_bench_pd import LAST_WARMED, PolledLate
    from router.policy.routing import Candidate, RouteRequest

    seen: list[tuple[str, list[int]]] = []

    class Recorder:
        name = "recorder"

        def choose(self, request: RouteRequest, candidates: list[Candidate]) -> str:
            seen.append(("choose", [c.num_requests for c in candidates]))
            return "chosen"

        def record(self, request: RouteRequest, candidates: list[Candidate], worker: str) -> None:
            seen.append(("record", [c.num_requests for c in candidates]))

    late = PolledLate(Recorder(), LAST_WARMED)  # type: ignore[arg-type]
    idle = [Candidate(WorkerId(w), 0, 0, None, None) for w in ("w0", LAST_WARMED)]
    for _ in range(2):
        late.choose(RouteRequest(64, 16, 0.0), idle)
        late.record(RouteRequest(64, 16, 0.0), idle, WorkerId("w0"))
    assert seen == [
        ("choose", [0, 1]),
        ("record", [0, 1]),
        ("choose", [0, 0]),
        ("record", [0, 0]),
    ]
    assert late.name == "recorder"
