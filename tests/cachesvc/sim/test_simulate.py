"""The simulator's bookkeeping on hand-made traces: the oracle, hits counted block by block, the
tiers' fetches, the index fed by the workers' events, and the command line."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import sim_support

from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, TierReadCost, load_profile
from cachesvc.sim.cost_profile import list_profiles as stored_profiles
from cachesvc.sim.loop import ClusterSpec, SimRun, replay
from cachesvc.sim.report import oracle_ratio, summarize
from cachesvc.sim.trace import (
    BLOCK_SIZE,
    block_hash,
    load_trace,
    num_unique_blocks,
    oracle_hit_blocks,
)

# A millisecond per token, whole prompts in one step: time is easy to reason about; a DRAM and
# an NVMe tier, and the default pull.
UNIT = dataclasses.replace(
    sim_support.UNIT,
    tiers={"dram": TierReadCost(0.0, 1e-9), "nvme": TierReadCost(1e-3, 1e-6)},
    peer=CostProfile.__dataclass_fields__["peer"].default,
)


TraceRows = list[tuple[float, int, int, list[int]]]
WriteTrace = Callable[[TraceRows], Path]  # conftest's write_trace


def _prompt(num_blocks: int) -> int:
    """A prompt of `num_blocks` full blocks and one token more: every block can be a hit."""
    return num_blocks * BLOCK_SIZE + 1


def _cached(run: SimRun) -> list[dict[str, int]]:
    return [s.cached for s in sorted(run.seqs, key=lambda s: s.req.index)]


def _check_integrity(run: SimRun) -> None:
    for w in run.workers:
        w.pool.check_integrity()
        if w.tiers is not None:
            w.tiers.check_integrity()


def test_trace_rows_become_requests(write_trace: WriteTrace) -> None:
    path = write_trace([(2000, 1500, 7, [5, 6, 7]), (1000, 1024, 0, [5, 6])])
    first, second = load_trace(path, time_scale=0.5)
    assert (first.arrival_s, second.arrival_s) == (0.0, 0.5), "sorted, scaled, from the first"
    assert first.hashes == (block_hash(5), block_hash(6))
    assert (first.num_full_blocks, first.max_match_blocks) == (2, 1), "the last token's block"
    assert (second.num_full_blocks, second.max_match_blocks) == (2, 2)
    assert first.output_len == 1, "an empty output still samples one token"
    assert num_unique_blocks([first, second]) == 3


def test_the_oracle_has_seen_every_earlier_request(write_trace: WriteTrace) -> None:
    rows = [
        (0, _prompt(3), 1, [1, 2, 3]),
        (1, _prompt(4), 1, [1, 2, 3, 4]),
        (2, _prompt(2), 1, [1, 9]),
        (3, 3 * BLOCK_SIZE, 1, [1, 2, 3]),  # the last block holds the last token: 2 at most
    ]
    requests = load_trace(write_trace(rows))
    assert oracle_hit_blocks(requests) == [0, 3, 1, 2]
    prompt = sum(r.prompt_len for r in requests)
    assert oracle_ratio(requests) == pytest.approx(6 * BLOCK_SIZE / prompt)


def test_small_capacity_hits_by_hand(write_trace: WriteTrace) -> None:
    # One worker of 4 blocks, requests one after another (1 ms per token, so 2 s apart is idle):
    # r0 registers blocks 1, 2 (its third holds the last token); r1 hits them and adds 3;
    # r2 needs all 4 blocks and evicts everything; r3 finds nothing left.
    rows = [
        (0, _prompt(2), 1, [1, 2, 3]),
        (2000, _prompt(3), 1, [1, 2, 3, 4]),
        (4000, _prompt(3), 1, [4, 5, 6, 7]),
        (6000, _prompt(2), 1, [1, 2, 8]),
    ]
    requests = load_trace(write_trace(rows))
    run = replay(requests, UNIT, ClusterSpec(1, device_blocks=4), "round_robin")
    assert _cached(run) == [{"hbm": 0}, {"hbm": 1024}, {"hbm": 0}, {"hbm": 0}]
    assert oracle_hit_blocks(requests) == [0, 2, 0, 2]
    summary = summarize(run, requests)
    assert summary.hit_ratio == pytest.approx(1024 / sum(r.prompt_len for r in requests))
    assert summary.ratio_to_oracle == pytest.approx(0.5)
    # Times: r0 computes 1025 tokens in one 1.025 s step; its first token is its only one.
    first = run.seqs[0]
    assert first.first_token_s == pytest.approx(1.025) and first.finish_s == first.first_token_s
    _check_integrity(run)


def test_evicted_blocks_come_back_from_dram(write_trace: WriteTrace) -> None:
    rows = [
        (0, _prompt(2), 1, [1, 2, 3]),
        (2000, _prompt(3), 1, [1, 2, 3, 4]),
        (4000, _prompt(3), 1, [4, 5, 6, 7]),
        (6000, _prompt(2), 1, [1, 2, 8]),
    ]
    requests = load_trace(write_trace(rows))
    run = replay(requests, UNIT, ClusterSpec(1, device_blocks=4, dram_blocks=8), "round_robin")
    assert _cached(run)[3] == {"hbm": 0, "dram": 1024}, "r2 demoted 1, 2; r3 fetched them"
    assert run.workers[0].plans == {"fetch": 1}
    _check_integrity(run)


def test_a_slow_tier_is_recomputed_not_fetched(write_trace: WriteTrace) -> None:
    slow = dataclasses.replace(UNIT, tiers={"dram": TierReadCost(1.0, 1e-3)})  # > 1 s a read
    rows = [
        (0, _prompt(2), 1, [1, 2, 3]),
        (4000, _prompt(3), 1, [4, 5, 6, 7]),
        (8000, _prompt(2), 1, [1, 2, 8]),
    ]
    requests = load_trace(write_trace(rows))
    run = replay(requests, slow, ClusterSpec(1, device_blocks=4, dram_blocks=8), "round_robin")
    assert _cached(run)[2] == {"hbm": 0}
    assert run.workers[0].plans == {"recompute": 1}


def _family_rows(num_requests: int = 40, every_ms: int = 150) -> TraceRows:
    """Requests of a few families that extend each other (a multi-turn shape), `every_ms`
    apart (by default they overlap: each computes for a second or more)."""
    rows = []
    for i in range(num_requests):
        family = i % 4
        depth = 1 + i // 4 % 5
        ids = [100 * family + k for k in range(depth + 2)]
        rows.append((i * every_ms, _prompt(depth + 1) + 100, 3 + i % 5, ids))
    return rows


def test_one_unlimited_worker_is_the_oracle(write_trace: WriteTrace) -> None:
    requests = load_trace(write_trace(_family_rows()))
    run = replay(requests, UNIT, ClusterSpec(1, device_blocks=10_000), "prefix_aware")
    hits = [sum(c.values()) // BLOCK_SIZE for c in _cached(run)]
    assert hits == oracle_hit_blocks(requests)
    assert summarize(run, requests).ratio_to_oracle == pytest.approx(1.0)


def test_one_unlimited_worker_is_the_oracle_on_the_sample_trace(sample_trace: Path) -> None:
    requests = load_trace(sample_trace, max_requests=300)
    run = replay(requests, UNIT, ClusterSpec(1, device_blocks=200_000), "least_loaded")
    hits = [sum(c.values()) // BLOCK_SIZE for c in _cached(run)]
    assert hits == oracle_hit_blocks(requests)


def test_the_index_follows_the_workers_events(write_trace: WriteTrace) -> None:
    requests = load_trace(write_trace(_family_rows(60)))
    spec = ClusterSpec(3, device_blocks=8, dram_blocks=4, nvme_blocks=4)
    run = replay(requests, UNIT, spec, "prefix_aware")
    assert len(run.seqs) == len(requests) and run.num_rejected == 0
    for w in run.workers:
        w.pool.check_integrity()
        assert w.tiers is not None
        w.tiers.check_integrity()
        held = {w.pool.block_hash(b) for b in range(w.pool.num_blocks)} - {None}
        for hashes in w.tiers.held_by_tier().values():
            held.update(hashes)
        assert run.index.num_blocks(w.worker_id) == len(held), w.worker_id
    assert sum(run.reasons.values()) == len(requests)
    assert set(run.assigned.values()) <= {w.worker_id for w in run.workers}


def test_affinity_keeps_families_together(write_trace: WriteTrace) -> None:
    requests = load_trace(write_trace(_family_rows(every_ms=4000)))  # no queues
    spec = ClusterSpec(3, device_blocks=64)  # round robin does not line up with 4 families
    aware = summarize(replay(requests, UNIT, spec, "prefix_aware"), requests)
    blind = summarize(replay(requests, UNIT, spec, "round_robin"), requests)
    # Four families on three workers: the one holding two is the busiest, and balancing busy
    # time moves a family once (its next request recomputes what it had).
    assert aware.ratio_to_oracle > 0.95
    pinned = summarize(replay(requests, UNIT, spec, "prefix_aware", {"busy_weight": 0}), requests)
    assert pinned.ratio_to_oracle == pytest.approx(1.0)
    assert blind.hit_ratio < aware.hit_ratio
    assert "no cached prefix" in " ".join(aware.decisions)


def test_a_request_no_pool_can_hold_is_rejected(write_trace: WriteTrace) -> None:
    requests = load_trace(write_trace([(0, _prompt(8), 1, list(range(9)))]))
    run = replay(requests, UNIT, ClusterSpec(2, device_blocks=4), "least_loaded")
    assert run.num_rejected == 1 and not run.seqs


def test_preempted_requests_still_finish(write_trace: WriteTrace) -> None:
    # Two long decodes on 5 blocks: the second outgrows the pool and is preempted.
    rows = [(0, _prompt(1), 2 * BLOCK_SIZE, [1, 2]), (0, _prompt(1), 2 * BLOCK_SIZE, [3, 4])]
    requests = load_trace(write_trace(rows))
    run = replay(requests, UNIT, ClusterSpec(1, device_blocks=5), "round_robin")
    summary = summarize(run, requests)
    assert summary.num_requests == 2 and summary.num_preemptions >= 1
    _check_integrity(run)


def test_profiles_round_trip_and_the_stored_ones_load(tmp_path: Path) -> None:
    assert CostProfile.from_json(json.loads(json.dumps(UNIT.to_json()))) == UNIT
    assert "h100-llama3-8b" in stored_profiles()
    for name in stored_profiles():
        profile = load_profile(name)
        assert profile.step_s([(512, 0)], []) > profile.step_s([], [1000]) > 0
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        load_profile("no-such-profile")


def test_step_time_formula() -> None:
    p = CostProfile(
        "p",
        "",
        1.0,
        ComputeCost(alpha_s=1.0, beta_s=2.0, gamma_s=3.0),
        DecodeCost(base_s=0.5, per_seq_s=5.0, per_context_token_s=7.0),
    )
    # alpha + beta * 4 + gamma * 4 * (10 + 2) + per_seq * 2 + per_ctx * (3 + 5)
    assert p.step_s([(4, 10)], [3, 5]) == pytest.approx(1 + 8 + 144 + 10 + 56)
    # A decode-only step starts from the decode base instead of alpha.
    assert p.step_s([], [3, 5]) == pytest.approx(0.5 + 10 + 56)


def test_the_command_line_writes_json(tmp_path: Path, write_trace: WriteTrace) -> None:
    from cachesvc.app.cli.main import main

    trace = write_trace(_family_rows())
    out = tmp_path / "out.json"
    args = ["simulate", "--trace", str(trace), "--workers", "2", "--device-blocks", "50%"]
    args += ["--policy", "prefix_aware", "--policy", "least_loaded", "--json", str(out)]
    args += ["--sweep", "workers=1,2", "--route-queue-weight", "0.5"]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert [(r["label"], r["policy"]) for r in results] == [
        ("workers=1", "prefix_aware"),
        ("workers=1", "least_loaded"),
        ("workers=2", "prefix_aware"),
        ("workers=2", "least_loaded"),
    ]
    assert all(0 < r["ratio_to_oracle"] <= 1 for r in results)
    assert main(["simulate", "--trace", str(trace), "--route-queue-weight", "2"]) == 2
    assert main(["simulate", "--trace", str(trace), "--sweep", "colour=1,2"]) == 2


def test_decode_fit_recovers_its_coefficients() -> None:
    from cachesvc.bench.calibrate.run import fit_decode

    truth = DecodeCost(base_s=0.05, per_seq_s=0.004, per_context_token_s=1e-6)
    shapes = [(1, 256), (8, 2048), (1, 1024), (4, 4096)]
    samples = [(b, c, _decode_step(truth, b, c)) for b, c in shapes]
    fitted = fit_decode(samples)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.per_seq_s == pytest.approx(truth.per_seq_s, rel=1e-6)
    assert fitted.per_context_token_s == pytest.approx(truth.per_context_token_s, rel=1e-6)
    # Noise that would make a coefficient negative leaves it out instead.
    flat = fit_decode([(1, 256, 0.06), (8, 2048, 0.05), (4, 1024, 0.055)])
    assert min(flat.base_s, flat.per_seq_s, flat.per_context_token_s) >= 0


def _decode_step(d: DecodeCost, batch: int, context: int) -> float:
    return d.base_s + d.per_seq_s * batch + d.per_context_token_s * context


def test_the_bench_routing_sample_hashes_its_tokens(write_trace: WriteTrace) -> None:
    from cachesvc.sim.trace import bench_routing_requests

    rows = [(0, 1500, 50, [1, 2, 3]), (1000, 700, 2, [9, 8]), (3000, 1024, 5, [1, 2])]
    first, _, third = bench_routing_requests(write_trace(rows))
    assert (first.block_size, first.prompt_len, len(first.hashes)) == (16, 24, 1)
    assert third.hashes == first.hashes[:1], "equal hash ids, equal tokens, equal blocks"
    assert third.output_len == 5 and third.arrival_s == pytest.approx(20.0)
