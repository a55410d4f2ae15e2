"""`python -m cachesvc.bench.step.attention`: every cell that fits the pool is reported, per
layout, in time a token and layer that agrees with the pass it came from (no timing is
asserted: benchmarks are not tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.bench.step.attention import LAYERS, PAGE, main


@pytest.mark.parametrize("rows", [1, 3])
def test_small_grid_reports_each_fitting_cell_with_consistent_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: int
) -> None:
    path = tmp_path / "attention.json"
    argv = ["--batches", "1,2", "--contexts", "16,100,200", "--threads", "1", "--rows", str(rows)]
    argv += ["--repeats", "1", "--pool-blocks", "16", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["rows"] == rows
    cells = report["cells"]
    # 2 x 200 tokens need 26 pages: more than the pool's 16, so that cell is left out.
    fits = [(b, c) for b in (1, 2) for c in (16, 100, 200) if b * -(-c // PAGE) <= 16]
    assert [(c["batch"], c["context"]) for c in cells] == fits
    for cell in cells:
        for name in ("contiguous", "scattered", "in_cache"):
            token_layers = cell["batch"] * cell["context"] * LAYERS
            assert cell[name] > 0
            assert cell[name] == pytest.approx(1e6 * cell["pass_ms"][name] / token_layers)
    assert "ns a token and layer" in capsys.readouterr().out
