"""`prefill_schemes`: the seed's five shared-prefix prefill schemes, timed at the attention level.

M requests `[prefix P | suffix S_m]` share P. Per cell of a P x S x M grid each scheme's attention
(one layer; inputs, KV cache and layouts are built before timing, as in the seed's §5.2) is timed
and checked: every scheme's suffix-row output must equal naive's, so a wrong layout cannot be
timed. The schemes' steps are `workers.attention.scheme_cases`'s. `auto` is what `choose_scheme`
picks with the costs a worker of this backend and shape would calibrate at start (measured on a
grid of its own, or read from this machine's cache), `rule` what the built-in rule picks; each
with its time over the fastest measured scheme's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from cachesvc.workloads.table import format_table, write_json
from workers.attention.scheme_calibration import CalibrationTarget, scheme_costs
from workers.attention.scheme_cases import make_case, run_scheme, scheme_run
from workers.attention.schemes import SCHEMES, BatchShape, SchemeCosts, choose_scheme

Grid = tuple[Sequence[int], Sequence[int], Sequence[int]]
GPU_GRID: Grid = ((96, 8196), (4, 256), (2, 32))  # the seed's grid; 8196 % 16 = 4
# 2 CPU cores do ~0.1 TFLOP/s: the long prefix keeps the seed's 4-token partial last page.
CPU_GRID: Grid = ((96, 1028), (4, 128), (2, 32))
CPU_QUICK_GRID: Grid = ((96, 516), (4, 64), (2, 8))


@dataclass(frozen=True)
class BenchConfig:
    """Shapes and timing policy shared by the attention benchmarks."""

    backend: str
    device: str
    dtype: torch.dtype
    num_qo_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    warmup: int = 1
    min_iters: int = 3
    max_iters: int = 200
    min_seconds: float = 0.3

    @property
    def tolerance(self) -> float:
        return 1e-4 if self.dtype == torch.float32 else 5e-3

    @property
    def sm_scale(self) -> float:
        return float(self.head_dim) ** -0.5


def bench_config(backend: str, quick: bool) -> BenchConfig:
    """float32 on CPU for the torch backend; fp16 on the GPU with the seed's warm-up and iters."""
    if backend == "torch":
        # More rounds than the minimum while a cell is cheap: medians on a shared machine.
        seconds = 0.3 if quick else 2.0
        return BenchConfig(
            backend, "cpu", torch.float32, min_iters=2 if quick else 3, min_seconds=seconds
        )
    return BenchConfig(backend, "cuda", torch.float16, warmup=10, min_iters=100, max_iters=100)


def median_ms(fns: Mapping[str, Callable[[], object]], cfg: BenchConfig) -> dict[str, float]:
    """Median wall time in ms of each function, after `cfg.warmup` untimed rounds.

    The functions run in rounds, one call each per round, so a machine whose load changes during
    the run slows all of them alike (this machine is shared and noisy); each round shuffles the
    order, so no function always runs with the caches its predecessor warmed.
    """

    def sync() -> None:
        if cfg.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(cfg.warmup):
        for fn in fns.values():
            fn()
    order = random.Random(0)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 0
    while rounds < cfg.min_iters or (
        sum(map(sum, times.values())) < cfg.min_seconds and rounds < cfg.max_iters
    ):
        order.shuffle(names)
        for name in names:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Refuse to time a scheme whose suffix outputs differ from naive's."""
    diff = (got.float() - want.float()).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{name}: suffix outputs differ from naive's by {diff:.2e} > {tol}")


def bench_cell(
    p: int, s: int, m: int, cfg: BenchConfig, costs: SchemeCosts | None = None
) -> dict[str, Any]:
    """Time every scheme on one cell; returns the JSON record, with `choose_scheme`'s pick from
    `costs` (`auto`) and from the built-in rule (`rule`), each timed over the fastest."""
    case = make_case(p, s, m, cfg, seed=p * 1000 + s * 10 + m)
    runs = {scheme: scheme_run(scheme, case, cfg.backend) for scheme in SCHEMES}
    fns = {k: partial(run_scheme, run, case.kv_cache, cfg.sm_scale) for k, run in runs.items()}
    want = runs["naive"].suffix_rows(fns["naive"]())
    for scheme, run in runs.items():
        _check(scheme, run.suffix_rows(fns[scheme]()), want, cfg.tolerance)
    ms = median_ms(fns, cfg)
    best = min(ms.values())
    shape = BatchShape(p, s, m, cfg.backend)
    auto, rule = choose_scheme(shape, costs), choose_scheme(shape)
    return {
        "P": p,
        "S": s,
        "M": m,
        "backend": cfg.backend,
        "decode": False,
        "ms": ms,
        "auto": auto,
        "auto_ratio": ms[auto] / best,
        "auto_within_10pct": ms[auto] <= 1.1 * best,
        "rule": rule,
        "rule_ratio": ms[rule] / best,
    }


def run_prefill_schemes_bench(
    quick: bool,
    json_path: str | None,
    backend: str = "torch",
    *,
    grid: Grid | None = None,
    calibration: str = "auto",
) -> int:
    """Print the per-cell table (and write JSON); returns 0, or 1 if `auto` missed a cell.

    The torch backend runs a scaled-down grid on CPU in float32; any other backend runs the
    seed's grid on CUDA in fp16. `grid` = (P values, S values, M values) overrides either.
    `calibration` is the worker's `scheme_calibration` ("off": `auto` is the built-in rule).
    """
    cfg = bench_config(backend, quick)
    if grid is None:
        grid = GPU_GRID if backend != "torch" else CPU_QUICK_GRID if quick else CPU_GRID
    _print_header(cfg, grid)
    start = time.perf_counter()
    costs = scheme_costs(calibration_target(cfg), calibration)
    source = "built-in rule" if costs is None else f"{len(costs.cells)} calibrated cells"
    print(f"auto: {source} (ready in {time.perf_counter() - start:.1f} s)", flush=True)
    cells = []
    for p in grid[0]:
        for s in grid[1]:
            for m in grid[2]:
                cells.append(bench_cell(p, s, m, cfg, costs))
                print(f"P={p} S={s} M={m}: done", flush=True)
    print(table(cells))
    write_json(json_path, cells)
    return 0 if all(c["auto_within_10pct"] for c in cells) else 1


def calibration_target(cfg: BenchConfig) -> CalibrationTarget:
    """What a worker with the benchmark's backend, dtype, heads and page size calibrates."""
    return CalibrationTarget(
        cfg.backend,
        cfg.device,
        cfg.dtype,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.page_size,
    )


def _print_header(cfg: BenchConfig, grid: Grid) -> None:
    scaled = (
        "" if grid == GPU_GRID else f" (SCALED from the seed's GPU grid {_grid_text(GPU_GRID)})"
    )
    print(
        f"prefill schemes: backend {cfg.backend} on {cfg.device}, {str(cfg.dtype)[6:]}, "
        f"heads {cfg.num_qo_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
        f"page {cfg.page_size}, {torch.get_num_threads()} threads\n"
        f"grid {_grid_text(grid)}{scaled}\n"
        f"ms = median of >= {cfg.min_iters} timed runs after {cfg.warmup} warm-up; "
        "(x) = speedup over naive; attention only, layouts and KV built before timing; "
        "auto / rule: the calibrated and the built-in pick, (x) = time over the fastest",
        flush=True,
    )


def _grid_text(grid: Grid) -> str:
    return " x ".join(f"{k}{{{', '.join(map(str, v))}}}" for k, v in zip("PSM", grid, strict=True))


def table(cells: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown table of `bench_cell` records: ms (speedup over naive) per scheme, then the
    calibrated (`auto`) and built-in (`rule`) picks with their time over the fastest."""
    rows = []
    for c in cells:
        ms = c["ms"]
        best = min(ms.values())
        timed = [f"{ms[k]:.3f} ({ms['naive'] / ms[k]:.2f}x)" for k in SCHEMES]
        picks = [f"{c[k]} ({ms[c[k]] / best:.2f}x)" if k in c else "-" for k in ("auto", "rule")]
        ok = "yes" if c["auto_within_10pct"] else "no"
        rows.append([c["P"], c["S"], c["M"], *timed, *picks, ok])
    return format_table(["P", "S", "M", *SCHEMES, "auto", "rule", "within 10%"], rows)
