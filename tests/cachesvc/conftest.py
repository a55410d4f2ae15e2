"""Fixtures of the benchmark and simulator tests: Mooncake trace files, written from rows or
generated like the public sample."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cachesvc.sim.generate import GeneratedTrace, generate_rows
from cachesvc.sim.generate import write_trace as write_rows

TraceRows = list[tuple[float, int, int, list[int]]]  # (timestamp ms, input len, output len, ids)


@pytest.fixture
def write_trace(tmp_path: Path) -> Callable[[TraceRows], Path]:
    """Writes rows as a Mooncake JSONL trace under the test's folder; returns its path."""

    def write(rows: TraceRows) -> Path:
        path = tmp_path / "t.jsonl"
        lines = [
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
            for t, n, o, ids in rows
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


@pytest.fixture(scope="session")
def sample_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mooncake trace file shaped like the public sample (some 380 requests over three minutes:
    conversations and agents whose prompts share system and tool prompts and grow turn by
    turn), generated (`cachesvc.sim.generate`): the tests need no data from outside the
    repository, and the same seed draws the same trace everywhere."""
    rows = generate_rows(GeneratedTrace(rate_per_worker=4.0, duration_s=180.0), num_workers=1)
    path = tmp_path_factory.mktemp("trace") / "sample.jsonl"
    write_rows(rows, path)
    return path
