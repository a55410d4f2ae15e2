"""The prefill schemes' start-up calibration: real measurements on the tiny model's attention
shape, the per-machine cache, and the built-in rule as the fallback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cachesvc.kv.config import ConfigError
from workers.attention.scheme_calibration import (
    CalibrationTarget,
    cache_path,
    calibrate,
    load_costs,
    scheme_costs,
)
from workers.attention.schemes import SCHEMES, BatchShape, SchemeCosts, choose_scheme
from workers.config import EngineConfig
from workers.engine.scheme_plan import startup_costs
from workers.model.config import ModelConfig

# The tiny test model's attention (4 query heads, 2 KV heads, head_dim 16) on a grid small
# enough for a test; the rule's constants were measured for 16/8 heads of 128.
TINY = CalibrationTarget(
    "torch", "cpu", torch.float32, 4, 2, 16, 16, grid=((32, 256), (4, 64), (2, 8))
)


# One cell: enough to show the cache's behaviour, at a test's cost.
ONE_CELL = CalibrationTarget("torch", "cpu", torch.float32, 4, 2, 16, 16, grid=((32,), (4,), (2,)))


@pytest.fixture(scope="module")
def tiny_cells() -> list[dict]:
    return calibrate(TINY)


def test_calibration_times_every_scheme_on_every_cell(tiny_cells: list[dict]) -> None:
    assert [(c["P"], c["S"], c["M"]) for c in tiny_cells] == [
        (p, s, m) for p in (32, 256) for s in (4, 64) for m in (2, 8)
    ]
    for cell in tiny_cells:
        assert set(cell["ms"]) == set(SCHEMES), cell
        assert all(0 < ms < math.inf for ms in cell["ms"].values()), cell
        assert cell["backend"] == "torch" and cell["decode"] is False


def test_measured_costs_replace_the_rule_where_it_picks_a_slower_scheme(
    tiny_cells: list[dict],
) -> None:
    """On each measured cell the calibrated pick is that cell's fastest scheme; wherever the
    built-in rule's pick measured over 10% slower than that, the two differ."""
    costs = SchemeCosts.from_records(tiny_cells)
    for cell in tiny_cells:
        shape = BatchShape(cell["P"], cell["S"], cell["M"], "torch")
        ms = cell["ms"]
        chosen = choose_scheme(shape, costs)
        assert ms[chosen] == min(ms.values())
        if ms[choose_scheme(shape)] > 1.1 * min(ms.values()):
            assert chosen != choose_scheme(shape)


# This machine's `cachesvc bench prefill-schemes --quick` before calibration (ms, 1 thread): the
# rule picks multi_item at P516 S4 M2 (1.11x the best) and ragged at P96 S64 M8 (1.13x).
MEASURED = {
    (96, 64, 8): {"naive": 31.41, "split": 19.46, "ragged": 21.36, "cascade": 18.86,
                  "multi_item": 46.42, "custom_mask": 46.46},
    (516, 4, 2): {"naive": 66.37, "split": 35.03, "ragged": 35.59, "cascade": 35.56,
                  "multi_item": 38.91, "custom_mask": 39.62},
}  # fmt: skip


@pytest.mark.parametrize("cell", sorted(MEASURED))
def test_fed_this_machines_costs_the_choice_lands_within_ten_percent(
    cell: tuple[int, int, int],
) -> None:
    ms = MEASURED[cell]
    records = [{"P": p, "S": s, "M": m, "backend": "torch", "ms": t} for (p, s, m), t in MEASURED.items()]  # fmt: skip  # noqa: E501
    shape = BatchShape(*cell, backend="torch")
    assert ms[choose_scheme(shape)] > 1.1 * min(ms.values())  # the rule misses here
    chosen = choose_scheme(shape, SchemeCosts.from_records(records))
    assert ms[chosen] <= 1.1 * min(ms.values()), chosen


def test_between_cells_each_schemes_cost_is_interpolated_in_log_space() -> None:
    """Two cells, P 15 and 255 (log2(P + 1) 4 and 8): split costs 1 then 1000, cascade 10 at
    both. In log space split crosses cascade a third of the way (P ~39); the nearest cell alone
    would keep split up to halfway (P 63)."""
    records = [
        {"P": 15, "S": 4, "M": 2, "backend": "torch", "ms": {"split": 1.0, "cascade": 10.0}},
        {"P": 255, "S": 4, "M": 2, "backend": "torch", "ms": {"split": 1000.0, "cascade": 10.0}},
    ]
    costs = SchemeCosts.from_records(records)
    middle = costs.estimate(BatchShape(63, 4, 2, "torch"))
    assert middle == pytest.approx({"split": 1000**0.5, "cascade": 10.0})
    assert choose_scheme(BatchShape(30, 4, 2, "torch"), costs) == "split"
    assert costs.nearest(BatchShape(50, 4, 2, "torch")).fastest == "split"  # type: ignore[union-attr]
    assert choose_scheme(BatchShape(50, 4, 2, "torch"), costs) == "cascade"
    # Beyond the grid: clamped to the edge cell, not extrapolated.
    assert costs.estimate(BatchShape(4096, 4, 2, "torch")) == pytest.approx(records[1]["ms"])


def _fake_cells(target: CalibrationTarget, fastest: str) -> list[dict]:
    """Cells no measurement would give (one scheme 1000x ahead): seen back, they came from the
    cache."""
    ms = {s: (0.001 if s == fastest else 1.0) for s in SCHEMES}
    p, s, m = (levels[0] for levels in target.levels)
    return [{"P": p, "S": s, "M": m, "backend": target.backend, "decode": False, "ms": ms}]


def _write_cache(target: CalibrationTarget, folder: Path, cells: list[dict]) -> Path:
    path = cache_path(target.key(), folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": target.key(), "cells": cells}))
    return path


def test_a_cached_calibration_is_read_back_and_a_changed_key_misses(tmp_path: Path) -> None:
    # A real calibration round-trips through the file.
    stored = scheme_costs(ONE_CELL, "auto", tmp_path)
    assert (
        stored is not None
        and load_costs(cache_path(ONE_CELL.key(), tmp_path), ONE_CELL.key()) == stored
    )
    # What the file holds is what "auto" answers, without measuring.
    _write_cache(ONE_CELL, tmp_path, _fake_cells(ONE_CELL, "custom_mask"))
    cached = scheme_costs(ONE_CELL, "auto", tmp_path)
    assert cached is not None and cached.cells[0].ms["custom_mask"] == 0.001
    # Another page size (or machine, torch, threads, heads) is another key: measured afresh.
    other = CalibrationTarget(**{**ONE_CELL.__dict__, "page_size": 8})
    assert cache_path(other.key(), tmp_path) != cache_path(ONE_CELL.key(), tmp_path)
    fresh = scheme_costs(other, "auto", tmp_path)
    assert fresh is not None and fresh.cells[0].ms["custom_mask"] != 0.001
    # A file under the right name but another key inside is not used either.
    assert load_costs(cache_path(ONE_CELL.key(), tmp_path), other.key()) is None
    # "refresh" measures again and replaces the file.
    refreshed = scheme_costs(ONE_CELL, "refresh", tmp_path)
    assert refreshed is not None and refreshed.cells[0].ms["custom_mask"] != 0.001
    assert load_costs(cache_path(ONE_CELL.key(), tmp_path), ONE_CELL.key()) == refreshed


@pytest.mark.parametrize(
    "text", ["", "{not json", '{"key": 1}', '{"key": null, "cells": []}', "[1, 2]"]
)
def test_a_corrupt_cache_is_ignored(tmp_path: Path, text: str) -> None:
    path = cache_path(TINY.key(), tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    assert load_costs(path, TINY.key()) is None


def test_auto_measures_over_a_corrupt_cache_and_rewrites_it(tmp_path: Path) -> None:
    path = cache_path(ONE_CELL.key(), tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"key": ')  # a write cut short
    costs = scheme_costs(ONE_CELL, "auto", tmp_path)
    assert costs is not None and load_costs(path, ONE_CELL.key()) == costs


def test_an_incomplete_cached_cell_is_ignored(tmp_path: Path) -> None:
    cells = _fake_cells(TINY, "split")
    del cells[0]["ms"]["naive"]
    assert load_costs(_write_cache(TINY, tmp_path, cells), TINY.key()) is None


def test_the_rule_decides_when_calibration_is_off_or_fails(tmp_path: Path) -> None:
    shape = BatchShape(516, 4, 2, "torch")
    assert scheme_costs(TINY, "off", tmp_path) is None
    assert not list(tmp_path.iterdir())  # off neither reads nor writes
    # An attention backend that cannot run here: measuring fails, the worker still starts.
    broken = CalibrationTarget(**{**TINY.__dict__, "backend": "no-such-backend"})
    assert scheme_costs(broken, "auto", tmp_path) is None
    if not torch.cuda.is_available():  # a GPU target on a machine without one
        gpu = CalibrationTarget(**{**TINY.__dict__, "backend": "flashinfer", "device": "cuda"})
        assert scheme_costs(gpu, "auto", tmp_path) is None
    assert choose_scheme(shape, None) == choose_scheme(shape)
    with pytest.raises(ValueError, match="scheme calibration"):
        scheme_costs(TINY, "sometimes", tmp_path)


def _tiny_model_config() -> ModelConfig:
    return ModelConfig("llama", 64, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 256)


def test_startup_costs_are_keyed_by_the_engines_attention_shape(tmp_path: Path) -> None:
    """The engine's backend, device, dtype, heads and block size make the key: a cache written
    for exactly that target is what the engine gets (no measuring)."""
    target = CalibrationTarget("torch", "cpu", torch.float32, 4, 2, 16, 8)
    _write_cache(target, tmp_path, _fake_cells(target, "cascade"))
    costs = startup_costs(EngineConfig(block_size=8), _tiny_model_config(), tmp_path)
    assert costs is not None and costs.cells[0].ms["cascade"] == 0.001
    # A fixed scheme needs no costs; calibration off leaves the rule.
    assert startup_costs(EngineConfig(prefill_scheme="cascade"), _tiny_model_config()) is None
    off = EngineConfig(block_size=8, scheme_calibration="off")
    assert startup_costs(off, _tiny_model_config(), tmp_path) is None


def test_config_names_the_field_of_a_bad_calibration_mode() -> None:
    with pytest.raises(ConfigError, match="scheme_calibration"):
        EngineConfig(scheme_calibration="always")


@pytest.mark.parametrize("name", ["paged_decode_vec.h", "claim.h", "prefill_attention.cpp"])
def test_an_edit_to_any_kernel_source_or_header_changes_the_cache_key(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Costs measured with another kernel are stale: a header's edit (a prefetch in the decode
    kernel's, a shared one's) must miss the cache as a `.cpp` edit does."""
    from workers.attention import scheme_calibration

    before = scheme_calibration._kernel_sources()
    read = Path.read_bytes

    def edited(path: Path) -> bytes:
        return read(path) + (b"// edited" if path.name == name else b"")

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert scheme_calibration._kernel_sources() != before
