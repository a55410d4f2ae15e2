"""The benchmark pages state only figures of the raw output they link (scripts/check_bench_docs.py,
run by `make lint`): the committed pages pass, and an edited figure or a broken link fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_bench_docs.py"


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the README and docs/, to edit."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} should occur once in {path.name}"
    path.write_text(text.replace(old, new))


def test_the_committed_pages_pass() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("page", "old", "new", "shown"),
    [
        # a measured value (engine.json: 342.17 tok/s)
        ("benchmarks/engine.md", "| 1 | 128 | 16 | 342 |", "| 1 | 128 | 16 | 352 |", "352"),
        # a ratio against the same run's baseline row (prefix_cache.json: 25239 / 7828 ms)
        ("benchmarks/prefix-cache.md", "| 3.22 |", "| 3.52 |", "3.52"),
        # a percentile of a stored list (pd_live.json: the gaps' p99, 10733 ms)
        ("benchmarks/pd.md", "217 / 10733", "217 / 10233", "10233"),
        # a share of the run's memory copy (kv-transfer.json: 3.59 / 12.84 GB/s)
        ("benchmarks/kv-transfer.md", "| 3.59 | 28% |", "| 3.59 | 38% |", "38%"),
        # an index headline (prefill_schemes.json: naive / cascade at P1028 S4 M32)
        ("benchmarks.md", "(27.89x)", "(29.89x)", "29.89x"),
    ],
)
def test_an_edited_figure_fails(checkout: Path, page: str, old: str, new: str, shown: str) -> None:
    edit(checkout / "docs" / page, old, new)
    result = run_check(checkout)
    assert result.returncode == 1
    assert f"docs/{page}" in result.stdout and shown in result.stdout, result.stdout


def test_a_moved_raw_output_fails(checkout: Path) -> None:
    results = checkout / "docs" / "results" / "engine"
    (results / "engine.json").rename(results / "engine_old.json")
    result = run_check(checkout)
    assert result.returncode == 1
    assert "broken link ../results/engine/engine.json" in result.stdout
    assert "engine_old.json: no benchmark page links it" in result.stdout


def test_a_link_to_a_missing_heading_fails(checkout: Path) -> None:
    edit(
        checkout / "docs" / "benchmarks.md",
        "benchmarks/pd.md#result-live-2026-12-02",
        "benchmarks/pd.md#live",
    )
    result = run_check(checkout)
    assert result.returncode == 1
    assert "no heading #live in benchmarks/pd.md" in result.stdout
