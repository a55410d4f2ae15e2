"""Pulls between simulated workers: the holder hint, a pull's timing and landing, the planner
refusing a slow peer, and the hot-prefix workload on the command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sim_support import UNIT, WriteTrace

from cachesvc.kv.types import WorkerId
from cachesvc.sim.cost_profile import CostProfile, TierReadCost
from cachesvc.sim.loop import ClusterSpec, SimRun, replay
from cachesvc.sim.report import summarize
from cachesvc.sim.trace import BLOCK_SIZE, HotPrefix, hot_prefix_requests, load_trace
from cachesvc.sim.worker import SimWorker

# The parent computes its 528 tokens in 0.53 s, well before the forks come at 1 s; with 65
# requests the p99 TTFT is the second longest, not the parent's.
SMALL = HotPrefix(prefix_len=512, num_forks=64, suffix_len=16, output_len=4, rate=100.0)
SPEC = ClusterSpec(2, device_blocks=1024, block_size=SMALL.block_size)


def _hints_name_other_workers(run: SimRun) -> int:
    """Checks every holder hint of `run`; returns how many there were."""
    hinted = [s for s in run.seqs if s.peer is not None]
    for s in hinted:
        assert s.peer is not None
        assert s.peer.holder.worker_id != run.assigned[s.req.index], "a hint names the holder"
        assert s.peer.num_blocks > s.routed_blocks
    return len(hinted)


def test_a_pull_lands_after_its_transfer_and_the_puller_then_holds_the_blocks(
    write_trace: WriteTrace,
) -> None:
    # r0 computes blocks 1, 2 on w0; r1 shares them and goes to w1 (least loaded, w0 was
    # chosen last): it pulls both in 1 ms + 1024 bytes at 1 ns, computes nothing meanwhile,
    # then its last token in 1 ms. Without pulls it recomputes 1025 tokens (1.025 s).
    prompt = 2 * BLOCK_SIZE + 1
    rows = [(0, prompt, 1, [1, 2, 3]), (2000, prompt, 1, [1, 2, 4])]
    requests = load_trace(write_trace(rows))
    spec = ClusterSpec(2, device_blocks=8)
    run = replay(requests, UNIT, spec, "least_loaded", peer_pull=True)
    r1 = next(s for s in run.seqs if s.req.index == 1)
    assert run.assigned[1] == WorkerId("w1") and r1.peer is not None
    assert (r1.peer.holder.worker_id, r1.peer.num_blocks) == ("w0", 2)
    assert r1.cached == {"hbm": 0, "peer": 2 * BLOCK_SIZE}
    assert r1.first_token_s == pytest.approx(2.0 + 1e-3 + 2 * BLOCK_SIZE * 1e-9 + 1e-3)
    puller = run.workers[1]
    assert puller.plans == {"fetch": 1} and puller.loads.pulled_blocks == 2
    assert run.index.num_blocks(puller.worker_id) == 2, "the index learned the pulled blocks"
    assert summarize(run, requests).pulled_mib == pytest.approx(2 * BLOCK_SIZE / 2**20)
    puller.pool.check_integrity()
    off = replay(requests, UNIT, spec, "least_loaded")
    assert next(s for s in off.seqs if s.req.index == 1).first_token_s == pytest.approx(3.025)


def test_pulls_give_least_loaded_more_hits_and_a_lower_ttft_p99_on_hot_prefix() -> None:
    requests = hot_prefix_requests(SMALL)
    off = summarize(replay(requests, UNIT, SPEC, "least_loaded"), requests)
    run = replay(requests, UNIT, SPEC, "least_loaded", peer_pull=True)
    on = summarize(run, requests)
    assert on.hit_ratio > off.hit_ratio
    assert on.pulled_tokens > 0 and off.pulled_tokens == 0
    prompt = sum(r.prompt_len for r in requests)
    assert on.hit_by_tier["peer"] * prompt == pytest.approx(on.pulled_tokens)
    assert on.ttft_p99_ms < off.ttft_p99_ms / 2, "no fork waits for the prefix's recompute"
    assert on.policy == "least_loaded+pull"
    assert _hints_name_other_workers(run) > 0
    for w in run.workers:
        w.pool.check_integrity()


def test_a_holder_pays_for_staging_what_it_sends() -> None:
    # Each byte sent costs the holder's engine a microsecond between two of its steps (a
    # block here is a few hundred bytes): its busy time grows by what it staged while busy.
    requests = hot_prefix_requests(SMALL)
    free = replay(requests, UNIT, SPEC, "least_loaded", peer_pull=True)
    staging = dataclasses.replace(UNIT, stage_s_per_byte=1e-6)
    paid = replay(requests, staging, SPEC, "least_loaded", peer_pull=True)
    sent = sum(w.loads.pulled_bytes for w in paid.workers)
    export_s = sum(w.export_s for w in paid.workers)
    assert sent > 0 and 0 < export_s <= sent * 1e-6 + 1e-9
    assert all(w.export_s == 0 for w in free.workers)
    assert sum(w.busy_s for w in paid.workers) > sum(w.busy_s for w in free.workers)
    assert CostProfile.from_json(staging.to_json()) == staging


def test_a_peer_slower_than_recomputing_is_never_pulled() -> None:
    # Each pull would wait 10 s, longer than recomputing any prompt here: a plan has no pull,
    # not even a split, and the replay is the one without pulls.
    slow = dataclasses.replace(UNIT, peer=TierReadCost(10.0, 1e-9))
    requests = hot_prefix_requests(SMALL)
    run = replay(requests, slow, SPEC, "least_loaded", peer_pull=True)
    assert _hints_name_other_workers(run) > 0, "the router still names holders"
    assert sum(w.plans["recompute"] for w in run.workers) > 0
    for w in run.workers:
        assert set(w.plans) <= {"recompute"} and w.loads.pulled_blocks == 0
    off = replay(requests, slow, SPEC, "least_loaded")
    assert [s.first_token_s for s in run.seqs] == [s.first_token_s for s in off.seqs]


def test_affinity_alone_never_hints_and_every_hint_names_another_worker() -> None:
    requests = hot_prefix_requests(SMALL)
    spec = dataclasses.replace(SPEC, num_workers=3)
    affinity = replay(requests, UNIT, spec, "longest_prefix", peer_pull=True)
    assert _hints_name_other_workers(affinity) == 0, "the chosen worker is the holder"
    for policy in ("round_robin", "least_loaded", "prefix_aware"):
        assert _hints_name_other_workers(replay(requests, UNIT, spec, policy, peer_pull=True))


def test_a_worker_reports_a_pull_cost_only_with_pulls_on() -> None:
    plain = SimWorker(WorkerId("w"), UNIT, 16, block_size=16)
    assert plain.block_costs() is None
    pulling = SimWorker(WorkerId("w"), UNIT, 16, block_size=16, peer_pull=True)
    costs = pulling.block_costs()
    assert costs is not None and set(costs.fetch_s) == {"peer"}
    assert costs.fetch_s["peer"] == pytest.approx(16 * 1.0 * 1e-9)  # bytes x seconds per byte
    with_dram = dataclasses.replace(UNIT, tiers={"dram": UNIT.peer})
    costs = SimWorker(WorkerId("w"), with_dram, 16, dram_blocks=4).block_costs()
    assert costs is not None and set(costs.fetch_s) == {"dram"}


def test_a_profile_without_a_peer_entry_gets_the_workers_prior() -> None:
    from cachesvc.kv.calibration import DEFAULT_TIER_COSTS

    data = UNIT.to_json()
    del data["peer"]
    assert CostProfile.from_json(data).peer == TierReadCost(*DEFAULT_TIER_COSTS["peer"])
    assert CostProfile.from_json(json.loads(json.dumps(UNIT.to_json()))) == UNIT


def test_the_command_line_runs_hot_prefix(tmp_path: Path) -> None:
    from cachesvc.app.cli.main import main

    out = tmp_path / "out.json"
    args = ["simulate", "--workload", "hot-prefix", "--workers", "2", "--prefix-len", "256"]
    args += ["--num-forks", "8", "--peer-gbps", "100", "--json", str(out)]
    assert main(args) == 0
    results = {r["policy"]: r for r in json.loads(out.read_text())}
    assert list(results) == [
        "longest_prefix",
        "least_loaded",
        "least_loaded+pull",
        "prefix_aware+pull",
    ]
    assert results["least_loaded+pull"]["pulled_tokens"] > 0
    assert results["least_loaded"]["pulled_tokens"] == 0
    assert all(r["throughput_tok_s"] > 0 for r in results.values())
    args = ["simulate", "--workload", "hot-prefix", "--num-forks", "4", "--json", str(out)]
    assert main([*args, "--policy", "round_robin", "--policy", "round_robin+pull"]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == ["round_robin", "round_robin+pull"]
    assert main([*args, "--policy", "least_loaded", "--peer-pull"]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == [
        "least_loaded",
        "least_loaded+pull",
    ]
    assert main([*args, "--policy", "least_loaded+push"]) == 2
    assert main(["simulate"]) == 2, "the trace workload still needs a trace"
