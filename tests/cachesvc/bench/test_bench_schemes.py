"""Smoke runs of the shared-prefix benchmarks on a one-cell grid (benchmarks are not tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cachesvc.bench.decode_cascade import run_decode_cascade_bench
from cachesvc.bench.prefill_schemes import bench_config, run_prefill_schemes_bench
from workers.attention.scheme_cases import SchemeRun, make_case, run_scheme, scheme_run
from workers.attention.schemes import SCHEMES, SchemeCosts, choose_scheme


def test_prefill_bench_writes_a_cell_per_grid_point(tmp_path: Path, capsys) -> None:
    path = tmp_path / "prefill.json"
    # Calibration off: `auto` is then the built-in rule, and the smoke run stays short.
    status = run_prefill_schemes_bench(
        True, str(path), grid=((20,), (3,), (2, 3)), calibration="off"
    )
    assert status in (0, 1)  # 1 only says auto missed the 10% band on this noisy machine
    cells = json.loads(path.read_text())
    assert [(c["P"], c["S"], c["M"]) for c in cells] == [(20, 3, 2), (20, 3, 3)]
    for cell in cells:
        assert set(cell["ms"]) == set(SCHEMES) and cell["backend"] == "torch"
        assert cell["auto"] in SCHEMES and cell["auto"] == cell["rule"]
        assert cell["auto_ratio"] >= 1.0
    assert "SCALED" in capsys.readouterr().out
    # The file is what SchemeCosts reads back.
    costs = SchemeCosts.from_records(cells)
    assert choose_scheme(costs.cells[0].shape, costs) == costs.cells[0].fastest


def test_decode_bench_writes_ideal_ratio(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    assert run_decode_cascade_bench(True, str(path), grid=((32,), (3,))) in (0, 1)
    (cell,) = json.loads(path.read_text())
    assert cell["decode"] and set(cell["ms"]) == {"ragged", "cascade"}
    assert cell["ideal_ratio"] == pytest.approx(3 * (32 + 128) / (32 + 3 * 128))


def test_bench_refuses_a_scheme_that_differs_from_naive(monkeypatch) -> None:
    import cachesvc.bench.prefill_schemes as bench

    real = bench.scheme_run

    def broken(scheme, case, backend):
        run = real(scheme, case, backend)
        if scheme != "ragged":
            return run
        return SchemeRun(run.steps, lambda outs: run.suffix_rows(outs) + 1.0)

    monkeypatch.setattr(bench, "scheme_run", broken)
    with pytest.raises(AssertionError, match="ragged"):
        bench.bench_cell(20, 3, 2, bench_config("torch", quick=True))


def test_unaligned_prefix_case_keeps_each_copy_of_the_partial_page() -> None:
    cfg = bench_config("torch", quick=True)
    case = make_case(20, 3, 2, cfg)  # 20 = one full page of 16 + 4 tokens on each own page
    assert [t[:1] for t in case.tables] == [[0], [0]] and case.tables[0][1] != case.tables[1][1]
    run = scheme_run("naive", case, "torch")
    (out,) = run_scheme(run, case.kv_cache, cfg.sm_scale)
    # Both requests see the same prefix, so their prefix rows agree.
    torch.testing.assert_close(out[:20], out[23:43])
