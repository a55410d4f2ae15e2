"""Routing benchmark pieces that need no cluster: workloads are deterministic and keep their
prefix sharing, traces scale as asked, and the summary computes what the table reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.workloads.routing_report import RequestRecord, summarize
from cachesvc.workloads.sessions import (
    TraceScale,
    groups_workload,
    hash_block_tokens,
    hot_prefix_workload,
    load_mooncake,
    multiturn_workload,
    trace_workload,
)


def test_groups_share_their_system_prompt_and_are_deterministic() -> None:
    sessions = groups_workload(1000, num_groups=3, prompts_per_group=4, system_len=20, seed=1)
    assert sessions == groups_workload(
        1000, num_groups=3, prompts_per_group=4, system_len=20, seed=1
    )
    assert len(sessions) == 12 and len({s.prefix_ids for s in sessions}) == 3
    assert [s.arrival_s for s in sessions] == sorted(s.arrival_s for s in sessions)
    assert all(32 <= t < 1000 for s in sessions for t in s.prefix_ids)


def test_multiturn_sessions_have_turns() -> None:
    sessions = multiturn_workload(500, num_users=2, num_turns=3)
    assert [s.num_requests for s in sessions] == [3, 3]
    assert sessions[0].prefix_ids == sessions[1].prefix_ids  # the shared system prompt


def _write_trace(path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 50, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 700, "output_length": 2, "hash_ids": [9, 8]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_trace_replay_scales_lengths_time_and_keeps_sharing(tmp_path: Path) -> None:
    _write_trace(tmp_path / "t.jsonl")
    rows = load_mooncake(tmp_path / "t.jsonl")
    scale = TraceScale(block_tokens=4, max_blocks=8, families=1, duration_s=6.0, max_output=3)
    sessions = trace_workload(rows, 100, scale)
    assert [s.arrival_s for s in sessions] == [0.0, 6.0]  # only family "1", re-timed
    first, second = sessions
    assert len(first.prefix_ids) == 12  # ceil(1500 * 4 / 512) = 12 = three blocks
    assert second.prefix_ids == first.prefix_ids[:8], "equal hash ids, equal tokens"
    assert first.prefix_ids[:4] == hash_block_tokens(1, 4, 100)
    assert [s.turns[0].max_tokens for s in sessions] == [3, 3]


def test_bad_trace_rows_name_the_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_mooncake(tmp_path / "bad.jsonl")


def test_the_sample_trace_keeps_prefix_sharing(sample_trace: Path) -> None:
    sessions = trace_workload(load_mooncake(sample_trace), 49152, TraceScale())
    seen: set[tuple[int, ...]] = set()
    reused = 0
    for s in sessions:
        blocks = [s.prefix_ids[i : i + 8] for i in range(0, len(s.prefix_ids) - 7, 8)]
        reused += sum(1 for b in blocks if b in seen)
        seen.update(blocks)
    assert reused > len(seen), "a sample of the busiest prefix families shares most blocks"


def test_summary_hit_ratio_percentiles_and_imbalance() -> None:
    records = [
        RequestRecord("w0", 100, 50, 50, 4, 0.010, 0.1),
        RequestRecord("w0", 100, 100, 0, 4, 0.020, 0.1),
        RequestRecord("w1", 100, 0, 100, 4, 0.030, 0.1),
    ]
    result = summarize("p", "groups", records, ["w0", "w1", "w2"], num_errors=1, wall_s=2.0)
    assert result.hit_ratio == pytest.approx(0.5)
    assert result.computed_tokens == 150
    assert result.ttft_p50_ms == pytest.approx(20.0)
    # Interpolated between the 2nd and 3rd: 20 + 0.98 * (30 - 20).
    assert result.ttft_p99_ms == pytest.approx(29.8)
    assert result.throughput_tok_s == pytest.approx(6.0)
    assert result.imbalance == pytest.approx(2 / 1)  # w0 served 2, the mean is 1
    assert result.num_errors == 1


def test_hot_prefix_forks_one_context_after_its_parent() -> None:
    sessions = hot_prefix_workload(700, prefix_len=40, num_forks=5, suffix_len=6, fork_at_s=2.0)
    parent, *forks = sessions
    assert parent.arrival_s == 0.0 and len(forks) == 5
    assert all(f.prefix_ids == parent.prefix_ids and len(f.prefix_ids) == 40 for f in forks)
    assert all(f.arrival_s >= 2.0 for f in forks)
    assert len({f.turns[0].question_ids for f in sessions}) == 6  # a suffix of its own each
    assert sessions == hot_prefix_workload(
        700, prefix_len=40, num_forks=5, suffix_len=6, fork_at_s=2.0
    )
