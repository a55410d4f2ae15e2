"""Plain-text tables, JSON files and percentiles for benchmark results.

`percentile` is the one percentile every bench and the simulator report: q as a percent
(0..100), linear interpolation between the closest ranks (numpy's default), NaN of nothing.
Raw JSON recorded under docs/results before it existed was computed with the older per-bench
conventions (nearest rank, q as a fraction, 0.0 of nothing); the figures in docs stay as
recorded, and a re-run may move a p99 by up to one rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into docs)."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, rule, *body])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_json(path: str | None, payload: Any) -> None:
    """Write `payload` as indented JSON when a path is given."""
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`th percentile of `values`, `q` a percent in 0..100.

    Linear interpolation between the two closest ranks (numpy's default, "inclusive"): the
    0th is the minimum, the 100th the maximum, the 50th the median. An empty list gives NaN,
    not 0.0 and not an error: a run that measured nothing (no inter-token gap with
    max_tokens=1, a phase with no long prompt) must not read as a real 0 ms figure, nor
    crash a bench after minutes of measuring; NaN prints as "nan" in tables and JSON.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be a percent in 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
