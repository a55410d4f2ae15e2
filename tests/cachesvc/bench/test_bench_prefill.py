"""`python -m cachesvc.bench.step.prefill`: every shape and thread count is reported, with a
rate that agrees with the call's time and the causal pairs it attends over (no timing is
asserted: benchmarks are not tests); a shape it cannot run is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.bench.step.prefill import HEAD_DIM, QUERY_HEADS, main, visible_pairs


def test_visible_pairs_count_a_bottom_right_causal_chunk() -> None:
    assert visible_pairs(3, 3) == 1 + 2 + 3
    assert visible_pairs(2, 5) == 4 + 5  # two queries after three cached keys
    assert visible_pairs(1, 1) == 1


def test_each_shape_is_reported_with_a_consistent_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prefill.json"
    argv = ["--shapes", "7x7,70x130", "--threads", "1,2", "--repeats", "1", "--json", str(path)]
    assert main(argv) == 0
    cells = json.loads(path.read_text())["cells"]
    assert [(c["threads"], c["queries"], c["keys"]) for c in cells] == [
        (1, 7, 7),
        (1, 70, 130),
        (2, 7, 7),
        (2, 70, 130),
    ]
    for cell in cells:
        flops = 4 * HEAD_DIM * QUERY_HEADS * visible_pairs(cell["queries"], cell["keys"])
        assert cell["gflops"] == pytest.approx(flops / cell["ms"] / 1e6)
    assert "prefill attention" in capsys.readouterr().out


@pytest.mark.parametrize("shape", ["9x5", "0x4", "ax4", "12"])
def test_a_shape_it_cannot_run_is_refused(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--shapes", shape])
    assert "QxK" in capsys.readouterr().err
