"""`cachesvc bench pd` end to end on the tiny model, as a user runs it (its own Ray cluster, in
its own process): with `--pd-mode always` the prefill + decode setup hands every long prompt
off, and the report carries the hand-offs the client saw, the KV moved and the router's reason
for each; two mixed workers hand nothing off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import run_cli

from cachesvc.workloads.pd import BLOCK_SIZE, DECODE_PROMPT_LEN, WITH_PROMPTS, PDShape

pytestmark = pytest.mark.system


def test_bench_pd_reports_every_hand_off(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    args = ["bench", "pd", "--quick", "--tiny", "--pd-mode", "always", "--json", str(out)]
    run_cli(args)
    shape = PDShape(quick=True)
    phases = {(r["setup"], r["phase"]): r for r in json.loads(out.read_text())}
    assert len(phases) == 4
    split = phases[("1 prefill + 1 decode", WITH_PROMPTS)]
    assert split["disaggregated"] == shape.long_prompts
    assert split["decisions"] == ["always"] * shape.long_prompts
    assert len(split["handoff_s"]) == shape.long_prompts
    # Whole blocks of the prompts, at most all of them (the tiny model computes a prompt faster
    # than it pulls one, so its planner may recompute instead).
    full = (shape.long_tokens + 1) // BLOCK_SIZE * BLOCK_SIZE
    assert 0 <= split["kv_moved_tokens"] <= shape.long_prompts * full
    assert split["kv_moved_tokens"] % BLOCK_SIZE == 0
    # The decode worker pulled while the prefills ran (the long prompts', and with `always` the
    # streams' too), and what landed so counts as moved (the tiny model's steps are too short
    # to say whether a chunk left before its prompt was all computed).
    streams = shape.streams * (DECODE_PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE)
    assert 0 < split["prefetched_tokens"] <= split["kv_moved_tokens"] + streams
    assert "early_chunks" in split
    mixed = phases[("2 mixed", WITH_PROMPTS)]
    assert mixed["disaggregated"] == 0 and mixed["kv_moved_tokens"] == 0
    assert mixed["prefetched_tokens"] == 0
    assert len(mixed["ttft_s"]) == shape.long_prompts
    assert all(len(r["gaps_s"]) > 0 for r in phases.values())
