"""Clusters of different sizes under the same load per worker: arrivals scaled to the cluster,
generated traces at a rate per worker, and prefix_aware's balance as the cluster grows."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from cachesvc.sim.cost_profile import load_profile
from cachesvc.sim.generate import GeneratedTrace, generate_rows, write_trace
from cachesvc.sim.loop import ClusterSpec, replay
from cachesvc.sim.report import oracle_ratio, summarize
from cachesvc.sim.simulate import SimulateArgs, load_requests
from cachesvc.sim.trace import load_trace, trace_requests

SAMPLE = Path(__file__).resolve().parents[4] / "shared/data/mooncake_synthetic_trace.jsonl"


def test_scaled_arrivals_give_each_worker_the_same_load() -> None:
    args = SimulateArgs(trace=str(SAMPLE), max_requests=200, scale_arrivals=8)
    eight = load_requests(dataclasses.replace(args, workers=8))
    thirty_two = load_requests(dataclasses.replace(args, workers=32))
    assert [r.arrival_s / 4 for r in eight] == pytest.approx([r.arrival_s for r in thirty_two])
    assert [r.hashes for r in eight] == [r.hashes for r in thirty_two]
    unscaled = load_requests(dataclasses.replace(args, workers=32, scale_arrivals=None))
    assert [r.arrival_s for r in unscaled] == [r.arrival_s for r in eight]


def test_a_generated_trace_grows_with_the_cluster(tmp_path: Path) -> None:
    shape = GeneratedTrace(rate_per_worker=0.5, duration_s=120.0)
    small, big = generate_rows(shape, 4), generate_rows(shape, 16)
    assert generate_rows(shape, 4) == small, "the same draw for the same seed"
    assert 3.0 < len(big) / len(small) < 5.3, "four times the workers, about four times the work"
    assert all(r.timestamp_ms < 120_000 for r in big)
    # Requests of a session extend its earlier prompts: the trace has prefixes to hit.
    assert oracle_ratio(trace_requests(big)) > 0.5
    write_trace(small, tmp_path / "g.jsonl")
    assert load_trace(tmp_path / "g.jsonl") == trace_requests(small)


def test_prefix_aware_stays_balanced_as_the_cluster_grows() -> None:
    # The same load per worker on 8 and on 32 workers. With a traffic bound whose slack and
    # decay were counted in decisions, the 32-worker cluster piled twice the mean of requests on
    # the holders of hot prompts (busy imbalance 1.9); now the bound means the same at any size.
    profile = load_profile("h100-llama3-8b")
    for num_workers in (8, 32):
        rows = generate_rows(GeneratedTrace(duration_s=90.0), num_workers)
        requests = trace_requests(rows)
        run = replay(requests, profile, ClusterSpec(num_workers, 1024), "prefix_aware")
        summary = summarize(run, requests, "", oracle_ratio(requests))
        per_worker = Counter(run.assigned.values())
        most = max(per_worker.values()) / (len(requests) / num_workers)
        assert most < 1.6, (num_workers, most)
        assert summary.busy_imbalance < 1.7, (num_workers, summary.busy_imbalance)
        assert summary.ratio_to_oracle > 0.9, (num_workers, summary.ratio_to_oracle)
