"""Admission in the simulator (`router.policy.admission`, `PDSetup.admit`): past capacity a
request predicted to start later than the target is refused, the ones admitted meet it, and a
refused request counts against goodput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_support import UNIT, WriteTrace

from cachesvc.sim.goodput import SLO, goodput
from cachesvc.sim.loop import ClusterSpec, PDSetup, replay
from cachesvc.sim.pd import COLOCATED, DYNAMIC
from cachesvc.sim.trace import BLOCK_SIZE, load_trace
from router.policy.admission import Admission

SLO_2S = SLO(ttft_ms=2000.0, itl_ms=100.0)


def _burst(write_trace: WriteTrace, num: int, gap_ms: float) -> Path:
    """`num` prompts of two blocks of their own (1.024 s of prefill each), every `gap_ms`, a
    4-token answer each: one worker keeps up with one a second."""
    rows = [(i * gap_ms, 2 * BLOCK_SIZE, 4, [2 * i + 1, 2 * i + 2]) for i in range(num)]
    return write_trace(rows)


@pytest.mark.parametrize("mode", [COLOCATED, DYNAMIC])
def test_past_capacity_admission_refuses_what_would_start_late(
    write_trace: WriteTrace, mode: str
) -> None:
    requests = load_trace(_burst(write_trace, 12, 250.0))  # four a second, four times too many
    spec = ClusterSpec(1 if mode == COLOCATED else 2, device_blocks=256)
    queued = replay(requests, UNIT, spec, "least_loaded", pd=PDSetup(mode))
    admitted = replay(requests, UNIT, spec, "least_loaded", pd=PDSetup(mode, admit=Admission(1.5)))
    everything, refusing = goodput(queued, SLO_2S), goodput(admitted, SLO_2S)

    assert not queued.refused and everything.num_refused == 0
    assert admitted.refused, "a growing queue is refused"
    served = {s.req.index for s in admitted.seqs}
    assert served.isdisjoint(r.index for r in admitted.refused)
    assert len(served) + len(admitted.refused) == len(requests)
    # Every admitted request starts within the SLO; queued, the late ones missed it.
    assert refusing.ttft_met * refusing.num_requests == len(served)
    assert everything.ttft_met < 1.0
    # A refused request counts as a request that met nothing.
    assert refusing.num_requests == len(requests)
    assert refusing.num_good == len(served)
    assert refusing.num_good > everything.num_good
    if mode == DYNAMIC:  # refused before its decision is kept or its prompt's share counted
        assert all(r.index not in admitted.pd_routes.decisions for r in admitted.refused)


def test_within_capacity_admission_refuses_nothing(write_trace: WriteTrace) -> None:
    requests = load_trace(_burst(write_trace, 6, 2000.0))  # one every 2 s: the worker keeps up
    spec = ClusterSpec(1, device_blocks=256)
    run = replay(requests, UNIT, spec, "least_loaded", pd=PDSetup(COLOCATED, admit=Admission(1.5)))
    assert not run.refused
    assert goodput(run, SLO_2S).num_good == len(requests)


def test_the_command_line_refuses_in_every_mode(tmp_path: Path, write_trace: WriteTrace) -> None:
    from cachesvc.app.cli.main import main

    # Twelve prompts of 60 blocks (30 720 tokens, about a second on an H100) at once, on two
    # workers: most would wait seconds for their first token.
    rows = [(i * 10.0, 60 * BLOCK_SIZE, 4, list(range(100 * i, 100 * i + 60))) for i in range(12)]
    base = ["simulate", "--trace", str(write_trace(rows)), "--workers", "2"]
    base += ["--device-blocks", "1024", "--admit-ttft-ms", "1500"]
    for mode in ("colocated", "dynamic"):
        out = tmp_path / f"{mode}.json"
        assert main([*base, "--pd", mode, "--json", str(out)]) == 0
        [run] = json.loads(out.read_text())["runs"]
        result = run["result"]
        assert result["num_requests"] == 12
        assert 0 < result["num_refused"] < 12
        assert result["num_good"] <= 12 - result["num_refused"]
    assert main([*base[:-1], "0", "--pd", "colocated"]) == 2


def test_the_live_admission_bench_replays_in_the_simulator() -> None:
    """`--like-bench-admission`: the capacity from the simulated warm-ups, the same burst in
    both setups, and with admission at 3 s the served requests start sooner and more of them
    within it (cpu-calibrated, the bench's --quick sizes)."""
    from cachesvc.sim.cost_profile import load_profile
    from cachesvc.sim.like_bench_admission import replay_bench_admission
    from cachesvc.workloads.admission import AdmissionBenchArgs

    without, with_ = replay_bench_admission(
        load_profile("cpu-calibrated"), AdmissionBenchArgs(quick=True)
    )
    assert without.offered_rps == with_.offered_rps > 0
    assert without.num_requests == with_.num_requests == round(10 * without.offered_rps)
    assert without.refused == 0 < with_.refused < with_.num_requests
    assert with_.within > without.within
    assert max(with_.ttft_s) < max(without.ttft_s)


@pytest.mark.parametrize(
    ("mode", "num_workers", "gap_ms"), [(COLOCATED, 1, 300.0), (DYNAMIC, 2, 120.0)]
)
def test_streams_past_their_inter_token_target_are_not_given_more_prompts(
    write_trace: WriteTrace, mode: str, num_workers: int, gap_ms: float
) -> None:
    """Prompts of 256 tokens (256 ms each on this clock) keep coming while 60-token answers
    decode: every prompt's step is a 256 ms gap for each stream beside it, and without an
    inter-token target for admission most streams miss 20 ms. With one, a request is refused
    while its worker's streams decode slower than that; more requests meet both targets."""
    rows = [(i * gap_ms, 256, 60, [i + 1]) for i in range(20)]
    requests = load_trace(write_trace(rows))
    slo = SLO(ttft_ms=5000.0, itl_ms=20.0)
    spec = ClusterSpec(num_workers, device_blocks=256)
    ttft_only = replay(requests, UNIT, spec, "least_loaded", pd=PDSetup(mode, admit=Admission(5.0)))
    both = PDSetup(mode, admit=Admission(5.0, 0.020))
    refusing = replay(requests, UNIT, spec, "least_loaded", pd=both)
    before, after = goodput(ttft_only, slo), goodput(refusing, slo)

    assert not ttft_only.refused, "every prompt starts in time: TTFT alone refuses nothing"
    assert before.itl_met < 0.5
    assert refusing.refused
    assert len(refusing.seqs) + len(refusing.refused) >= len(requests)
    assert after.num_good > before.num_good


def test_the_bench_replay_with_an_inter_token_target_adds_the_streams_setup() -> None:
    """`--like-bench-admission --admit-itl-ms`: the bench's third setup, on the same burst of
    longer answers; goodput counts both targets, and each served request has its mean gap."""
    from cachesvc.sim.cost_profile import load_profile
    from cachesvc.sim.like_bench_admission import replay_bench_admission
    from cachesvc.workloads.admission import AdmissionBenchArgs

    args = AdmissionBenchArgs(quick=True, itl_ms=500.0)
    results = replay_bench_admission(load_profile("cpu-calibrated"), args)
    assert [r.setup for r in results][-1] == "with admission on the streams"
    assert len({r.num_requests for r in results}) == 1
    for r in results:
        assert len(r.itl_s) == len(r.ttft_s) and all(g > 0 for g in r.itl_s)
        ttft_only = sum(t * 1e3 <= r.ttft_target_ms for t in r.ttft_s)
        assert r.within <= ttft_only
    without, ttft, streams = results
    assert streams.refused >= ttft.refused > without.refused == 0
