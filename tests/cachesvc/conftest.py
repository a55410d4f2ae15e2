"""Fixtures of the benchmark tests: Mooncake trace files written from rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

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
