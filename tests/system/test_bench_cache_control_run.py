"""`cachesvc bench cache-control` end to end on the tiny model, as a user runs it (its own Ray
cluster, in its own process): the retained prefix is a hit after a flood ten times the pool
where the unretained one is a miss; quotas keep alice's working set through bob's flood where
plain LRU loses it; every answer's usage adds up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import run_cli

from cachesvc.workloads.cache_control import (
    ALONE,
    BLOCK_SIZE,
    NO_QUOTAS,
    NO_RETENTION,
    QUOTAS,
    RETAINED,
    CacheControlShape,
)

pytestmark = pytest.mark.system


def test_bench_cache_control_shows_retention_and_quotas_at_work(tmp_path: Path) -> None:
    out = tmp_path / "cc.json"
    run_cli(["bench", "cache-control", "--quick", "--tiny", "--json", str(out)])
    report = json.loads(out.read_text())
    shape = CacheControlShape(quick=True)
    retention = {r["setup"]: r for r in report["retention"]}
    full = shape.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert retention[RETAINED]["after_cached_tokens"] == full
    assert retention[RETAINED]["retained_tokens"] == full
    assert retention[NO_RETENTION]["after_cached_tokens"] == 0
    assert retention[NO_RETENTION]["flood_tokens"] >= 10 * shape.pool_tokens
    quotas = {q["setup"]: q["cached_tokens"] / q["prompt_tokens"] for q in report["quotas"]}
    assert quotas[ALONE] > 0.8
    assert quotas[QUOTAS] >= 0.9 * quotas[ALONE]
    assert quotas[NO_QUOTAS] < 0.5 * quotas[ALONE]
    usage = report["usage"]
    assert usage and all(
        0 <= u["prompt_tokens"] - u["read_tokens"] - u["written_tokens"] <= BLOCK_SIZE
        for u in usage
    )
