"""`python -m cachesvc.bench.gpu_check --out DIR`: check and time the FlashInfer backend on one GPU.

The prepared device script of research notes §11, run by `make gpu-check` (docs/gpu.md). Each
phase has its own time cap and the whole script `TOTAL_S`; DIR/results.json is rewritten as soon
as a phase ends, and DIR/report.{json,md} (one page for docs/benchmarks.md) at the end:

1. build: every kernel module the backend loads, compiled (or loaded from FlashInfer's cache) by
   running the backend once per kind (prefill, decode, merge_state) for fp16 / head_dim 128 (the
   benchmarks) and bf16 / head_dim 64 (SmolLM2): public calls only.
2. correctness: every scheme against the torch backend on CPU copies, in float32 and in the
   checked dtype: error within `ERROR_RATIO` of the torch backend's own (`correctness.py`).
3. engine: a SmolLM2-135M-shaped bf16 model (random weights unless `--model`): teacher-forced
   logits within `ERROR_RATIO` of the torch backend's bf16 error against float32, and greedy
   tokens via `Engine` equal to the torch backend's until they part at a near-tie.
4. timing: cascade decode on P {1K, 8K, 32K} x N {8, 32, 128}, then the five prefill schemes on
   the seed's P x S x M grid, cell by cell.

`--backend torch --device cpu` runs the same phases against the torch backend itself: a dry run of
this script on any machine. Exit status 0 when every phase ran and every check passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from itertools import product
from pathlib import Path
from typing import Any, TypeVar

import torch

from cachesvc.bench import decode_cascade, prefill_schemes
from cachesvc.bench.gpu_check import correctness as correctness
from cachesvc.bench.gpu_check.engine import phase_engine
from cachesvc.bench.gpu_check.report import Run, time_cap, write_report
from workers.attention.scheme_calibration import scheme_costs
from workers.attention.schemes import make_scheme_backend

PHASES = ("build", "correctness", "engine", "timing")
CAPS_S = {"build": 150, "correctness": 90, "engine": 90, "timing": 150}
# The script's share of `make gpu-check`'s 8 minutes (the Makefile kills it at 400 s): the
# wheels' install (~20 s) and the `pytest -m gpu` run after it (45 s at most) take the rest.
TOTAL_S = 375

T = TypeVar("T")


# ---- phase 1: build ----------------------------------------------------------------------------


def _tag(shapes: correctness.Shapes) -> str:
    return f"{str(shapes.dtype)[6:]}/hd{shapes.head_dim}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def phase_build(run: Run) -> None:
    """Run each kind of kernel once per (dtype, head_dim): FlashInfer compiles what its wrappers
    load on first use (all mask modes are one prefill module), whatever this version names it."""
    built = run.results.setdefault("build", [])
    for shapes in correctness.CHECK_SHAPES:
        case = correctness.make_check_case(16, 4, 2, shapes, run.device)
        steps = correctness.scheme_steps(case)
        for kind, name in (("prefill", "ragged"), ("decode", "decode")):
            start = time.perf_counter()
            backend = make_scheme_backend(run.backend)
            correctness.attention(backend, case.q, case.kv_cache, steps[name], case)
            _sync(run.device)
            built.append({"kernel": f"{_tag(shapes)} {kind}", "s": time.perf_counter() - start})
            print(f"  {built[-1]['kernel']}: {built[-1]['s']:.1f} s", flush=True)
    start = time.perf_counter()
    correctness.compare_merge_state(correctness.CHECK_SHAPES[0], run.backend, run.device)
    built.append({"kernel": "merge_state", "s": time.perf_counter() - start})
    print(f"  merge_state: {built[-1]['s']:.1f} s", flush=True)
    if run.backend == "flashinfer":
        import flashinfer

        run.results["versions"]["flashinfer"] = flashinfer.__version__


# ---- phase 2: correctness ----------------------------------------------------------------------


def phase_correctness(run: Run) -> None:
    """Every scheme of every case against the torch backend in float32 and in its dtype."""
    reference = make_scheme_backend("torch")
    for shapes in correctness.CHECK_SHAPES:
        backend = make_scheme_backend(run.backend)
        for p, s, m in correctness.CASES:
            case = correctness.make_check_case(p, s, m, shapes, run.device)
            low_in = (case.q.cpu(), case.kv_cache.cpu())
            f32_in = (low_in[0].float(), low_in[1].float())
            for name, step in correctness.scheme_steps(case).items():
                label = f"{_tag(shapes)} P={p} S={s} M={m} {name}"
                run_step = partial(
                    correctness.attention, backend, case.q, case.kv_cache, step, case
                )
                if (got := run.guarded(label, run_step)) is None:
                    continue
                low = correctness.attention(reference, *low_in, step, case)
                want = correctness.attention(reference, *f32_in, step, case)
                run.record(label, correctness.compare(got, low, want))
        merge = partial(correctness.compare_merge_state, shapes, run.backend, run.device)
        if (merged := run.guarded(f"{_tag(shapes)} merge_state", merge)) is not None:
            run.record(f"{_tag(shapes)} merge_state", merged)


# ---- phase 4: timing ---------------------------------------------------------------------------


def phase_timing(run: Run) -> None:
    """Both benchmarks cell by cell, the cheap decode cells first, so a cap keeps the cells
    already timed."""
    cfg = prefill_schemes.bench_config(run.backend, quick=run.quick)
    cells: dict[str, list[dict[str, Any]]] = {"decode": [], "prefill": []}
    run.results["timing"] = cells
    p_grid = ((96,), (4,), (2,)) if run.quick else prefill_schemes.GPU_GRID
    d_grid = ((1024,), (8,)) if run.quick else decode_cascade.GPU_GRID
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("decode", partial(decode_cascade.bench_cell, p, n, cfg)) for p, n in product(*d_grid)
    ]
    # `auto` as a worker on this GPU picks it: from the costs it calibrates at start.
    target = prefill_schemes.calibration_target(cfg)
    costs = run.guarded("scheme calibration", partial(scheme_costs, target))
    jobs += [
        ("prefill", partial(prefill_schemes.bench_cell, p, s, m, cfg, costs))
        for p, s, m in product(*p_grid)
    ]
    for i, (kind, job) in enumerate(jobs):
        # A cell whose schemes disagree with naive raises AssertionError: recorded, not timed.
        cell = run.guarded(f"timing {kind} cell {i}", job)
        if cell is None:
            continue
        cells[kind].append(cell)
        print(f"  {kind} P={cell['P']} S={cell['S']} M={cell['M']}: {cell['ms']}", flush=True)
        (run.out / f"{kind}_schemes.json").write_text(json.dumps(cells[kind], indent=2) + "\n")


# ---- driver ------------------------------------------------------------------------------------


def run_phases(run: Run, phases: Sequence[str]) -> bool:
    """Run `phases` in order under their caps; True when all ran and every check passed."""
    start = time.perf_counter()
    done = run.results.setdefault("phases", {})
    actions = {"build": phase_build, "correctness": phase_correctness}
    actions.update({"engine": phase_engine, "timing": phase_timing})
    for phase in phases:
        left = int(TOTAL_S - (time.perf_counter() - start))
        if left < 10:
            done[phase] = {"ok": False, "error": "no time left"}
            continue
        print(
            f"[{time.strftime('%H:%M:%S')}] {phase} (cap {min(CAPS_S[phase], left)} s)", flush=True
        )
        t0 = time.perf_counter()
        try:
            with time_cap(min(CAPS_S[phase], left)):
                actions[phase](run)
            done[phase] = {"ok": True}
        except Exception as err:  # a phase's failure is a result; the next phase still runs
            traceback.print_exc()
            done[phase] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        done[phase]["seconds"] = round(time.perf_counter() - t0, 1)
        run.save()
    checks = run.results.get("checks", [])
    run.results["ok"] = all(p["ok"] for p in done.values()) and all(c["ok"] for c in checks)
    run.save()
    write_report(run)
    return bool(run.results["ok"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.gpu_check", description=__doc__)
    parser.add_argument("--out", default="gpu-check-out", help="folder for results.json")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    parser.add_argument("--backend", default="flashinfer", help="backend under test")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="one timing cell per benchmark")
    parser.add_argument("--model", help="GGUF file or HF folder (default: random weights)")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; known: {PHASES}")
    run = Run(Path(args.out), args.backend, args.device, args.quick, args.model, {})
    info = {"python": platform.python_version(), "torch": torch.__version__}
    info["torch_cuda"] = str(torch.version.cuda)
    if args.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    with suppress(PackageNotFoundError):
        info["flashinfer"] = version("flashinfer-python")
    run.results["versions"] = info
    print(json.dumps(info), flush=True)
    ok = run_phases(run, phases)
    print(f"gpu_check: {'PASS' if ok else 'FAIL'}; results in {run.out / 'results.json'}")
    return 0 if ok else 1
