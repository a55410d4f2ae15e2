"""`cachesvc bench step` on the tiny model: the report's shape, phases that add up, and clocks
that leave the engine as they found it (benchmarks are not tests: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.app.cli.main import main
from cachesvc.bench.step.phases import HOST_PHASES, PHASES, PhaseClock, instrument
from cachesvc.bench.step.run import QUICK_GRID, StepBenchArgs


def test_quick_run_reports_every_cell_and_path_with_consistent_phases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "step.json"
    assert main(["bench", "step", "--tiny", "--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["model"] == "tiny" and report["dtype"] == "float32"
    assert report["copy_bandwidth_gb_s"] > 0 and report["skipped_cells"] == []
    batches, contexts = QUICK_GRID
    cells = report["cells"]
    assert sorted((c["batch"], c["context"]) for c in cells) == sorted(
        (b, c) for b in batches for c in contexts
    )
    for cell in cells:
        assert cell["weights_bytes"] > 0
        # Every request's context is in the KV the floor counts, at least the prompt.
        assert cell["kv_bytes"] >= cell["batch"] * cell["context"]
        assert cell["floor_ms"] > 0
        assert set(cell["paths"]) == {"in_place", "gather"}
        for summary in cell["paths"].values():
            assert set(summary["phases_ms"]) == set(PHASES)
            assert all(v >= 0 for v in summary["phases_ms"].values())
            # Exclusive phases: with the rest, they are the step; alone, no more than it.
            total = sum(summary["phases_ms"].values())
            assert total <= summary["step_ms_mean"] * (1 + 1e-9)
            assert total + summary["other_ms"] == pytest.approx(summary["step_ms_mean"])
            # The host's share: its phases, the rest of the step and the stream deltas.
            host = [summary["phases_ms"][p] for p in HOST_PHASES if p not in ("other", "stream")]
            host_ms = sum(host) + summary["other_ms"] + summary["stream_ms"]
            assert summary["host_ms"] == pytest.approx(host_ms)
            assert summary["stream_ms"] > 0 and summary["host_cpu_ms_median"] > 0
        assert cell["in_place_over_gather"] == pytest.approx(
            cell["paths"]["in_place"]["step_ms"] / cell["paths"]["gather"]["step_ms"]
        )
        # Only the gather path copies pages out of the cache; the model's own time is counted.
        gather, in_place = cell["paths"]["gather"], cell["paths"]["in_place"]
        assert gather["phases_ms"]["attn_gather"] > 0
        if report["kernel_built"]:
            assert in_place["phases_ms"]["attn_gather"] == 0
        assert in_place["phases_ms"]["weights"] > 0
    out = capsys.readouterr().out
    assert "in place ms" in out and "attn_gather" in out and "host cpu median" in out


def test_clocks_are_removed_when_the_context_exits(tmp_path: Path) -> None:
    import workers.engine.runner as runner_module
    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.model.tiny import write_tiny_model
    from workers.sampling_params import SamplingParams

    module_functions = dict(vars(runner_module))
    engine = Engine(EngineConfig(model=str(write_tiny_model(tmp_path / "m")), num_blocks=32))
    backend = engine.runner.backend
    clock = PhaseClock()
    with instrument(engine, clock, [backend]):
        assert "step" in vars(engine) and "forward" in vars(backend)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        phases = clock.take()
        assert phases["step"] > 0 and phases["weights"] > 0
    assert "step" not in vars(engine) and "forward" not in vars(backend)
    assert "schedule" not in vars(engine.scheduler)
    assert not engine.runner.model._forward_hooks and not engine.runner.model._forward_pre_hooks
    assert dict(vars(runner_module)) == module_functions


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="--steps"):
        StepBenchArgs(steps=0)


def test_a_shared_prefix_is_counted_once_in_the_floor(tmp_path: Path) -> None:
    """The same cell with every prompt starting alike reads the prefix once in its floor, and a
    context no longer than the prefix is left out, said so."""
    plain, shared = tmp_path / "plain.json", tmp_path / "shared.json"
    common = ["bench", "step", "--tiny", "--quick", "--batches", "4", "--contexts", "32,64"]
    assert main([*common, "--json", str(plain)]) == 0
    assert main([*common, "--shared-prefix", "32", "--json", str(shared)]) == 0
    plain_cells = {c["context"]: c for c in json.loads(plain.read_text())["cells"]}
    report = json.loads(shared.read_text())
    assert report["shared_prefix"] == 32
    assert [c["context"] for c in report["cells"]] == [64]
    assert report["skipped_cells"] == [
        {"batch": 4, "context": 32, "why": "no longer than the shared prefix"}
    ]
    # Four prompts of 64 sharing 32: the prefix's KV counted once, not four times (the tokens
    # each generated are the same in both runs: they follow the steps, not the prompts).
    saved = plain_cells[64]["kv_bytes"] - report["cells"][0]["kv_bytes"]
    assert saved == 3 * 32 * report["kv_bytes_per_token"] > 0
