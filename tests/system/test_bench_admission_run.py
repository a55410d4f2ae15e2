"""`cachesvc bench admission` end to end on the tiny model, as a user runs it (its own Ray
cluster, in its own process): both setups get the same burst at the same rate, every request
is either served or refused, and nothing is refused without admission (whether the tiny
model's burst is past the target depends on this machine's speed: the refusals themselves are
tested in `test_operations.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import run_cli

pytestmark = pytest.mark.system


def test_bench_admission_runs_both_setups_on_one_burst(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    args = ["bench", "admission", "--quick", "--tiny", "--seconds", "2", "--json", str(out)]
    done = run_cli(args)
    assert "goodput req/s" in done.stdout
    without, with_ = json.loads(out.read_text())
    assert (without["setup"], with_["setup"]) == ("without admission", "with admission")
    assert without["offered_rps"] == with_["offered_rps"] > 0
    sizes = [len(r["ttft_s"]) + r["refused"] for r in (without, with_)]
    assert sizes[0] == sizes[1] >= 1
    assert without["refused"] == 0, "nothing refuses without admission"
    assert with_["ttft_target_ms"] == 3000.0


def test_with_an_inter_token_target_a_third_setup_admits_on_the_streams(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    args = ["bench", "admission", "--quick", "--tiny", "--seconds", "2", "--itl-ms", "500"]
    done = run_cli([*args, "--max-tokens", "6", "--json", str(out)])
    assert "mean ITL target 500 ms" in done.stdout
    results = json.loads(out.read_text())
    assert [r["setup"] for r in results] == [
        "without admission",
        "with admission",
        "with admission on the streams",
    ]
    for r in results:
        assert r["itl_target_ms"] == 500.0
        assert len(r["itl_s"]) == len(r["ttft_s"]), "each served request's mean gap"
        assert all(gap > 0 for gap in r["itl_s"]), "six tokens: five gaps each"
        # Every setup sends the same burst, each request answered or refused once. (Without
        # admission a worker whose pool is full may still refuse a few on a loaded machine.)
        assert len(r["ttft_s"]) + r["refused"] == len(results[0]["ttft_s"]) + results[0]["refused"]


@pytest.mark.parametrize(
    "flag",
    [["--ttft-ms", "0"], ["--overload", "-1"], ["--seconds", "0"], ["--itl-ms", "0"]],
)
def test_bad_flags_are_refused_naming_them(flag: list[str]) -> None:
    from cachesvc.app.cli.main import main

    assert main(["bench", "admission", "--tiny", *flag]) == 2
