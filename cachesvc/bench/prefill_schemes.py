"""`prefill_schemes`: the seed's five shared-prefix prefill schemes, timed at the attention level.

M requests `[prefix P | suffix S_m]` share P. Per cell of a P x S x M grid each scheme's attention
(one layer; inputs, KV cache and layouts are built before timing, as in the seed's §5.2) is timed
and checked: every scheme's suffix-row output must equal naive's, so a wrong layout cannot be
timed. `auto` is what `choose_scheme` picks with its built-in rules, and whether that scheme is
within 10% of the fastest measured one.

Schemes (kernel level, as in the seed): naive = M requests of P+S tokens; split = request 0's
P+S in one step, then the other M-1 suffixes against the cached prefix pages in a later step;
ragged = rows `[P+S_0, S_1 .. S_{M-1}]` over block tables sharing the prefix pages; cascade =
causal prefill of P, then two-level attention of the suffixes plus merge; multi_item = one
logical request under the kMultiItemScoring mask; custom_mask = the same with a packed mask.
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
from workers.attention.schemes import (
    SCHEMES,
    BatchShape,
    SchemeBackend,
    SchemeLayout,
    build_scheme_layout,
    choose_scheme,
    make_scheme_backend,
)

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


@dataclass(frozen=True)
class SharedPrefixCase:
    """Random queries and a filled paged cache for M requests `[prefix | suffix_m]`.

    The prefix's full pages are shared (ids `0..P//page-1`); each request owns the pages after
    them, which hold the prefix's partial last page (same K/V in every copy) and its suffix.
    """

    prefix_len: int
    suffix_len: int
    num_requests: int
    page_size: int
    kv_cache: torch.Tensor  # [num_blocks, 2, page_size, Hk, D]
    tables: list[list[int]]
    q_prefix: torch.Tensor  # [P, Hq, D]
    q_suffix: torch.Tensor  # [M, S, Hq, D]


def make_case(p: int, s: int, m: int, cfg: BenchConfig, seed: int = 0) -> SharedPrefixCase:
    """Random q/k/v (standard normal) for one grid cell, on `cfg.device` in `cfg.dtype`."""
    gen = torch.Generator().manual_seed(seed)
    ps, hk, d = cfg.page_size, cfg.num_kv_heads, cfg.head_dim
    shared = p // ps
    own = -(-(p - shared * ps + s) // ps)
    tables = [list(range(shared)) + [shared + r * own + i for i in range(own)] for r in range(m)]
    kv_cache = torch.zeros(shared + m * own, 2, ps, hk, d)
    prefix_kv = torch.randn(p, 2, hk, d, generator=gen)
    for table in tables:
        kv = torch.cat([prefix_kv, torch.randn(s, 2, hk, d, generator=gen)])
        pages = torch.tensor(table)[torch.arange(p + s) // ps]
        kv_cache[pages, :, torch.arange(p + s) % ps] = kv
    q_prefix = torch.randn(p, cfg.num_qo_heads, d, generator=gen)
    q_suffix = torch.randn(m, s, cfg.num_qo_heads, d, generator=gen)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=cfg.device, dtype=cfg.dtype)

    return SharedPrefixCase(p, s, m, ps, put(kv_cache), tables, put(q_prefix), put(q_suffix))


@dataclass(frozen=True)
class Step:
    """One forward pass: its queries, its layout and the backend instance that plans it."""

    backend: SchemeBackend
    q: torch.Tensor
    layout: SchemeLayout


@dataclass(frozen=True)
class SchemeRun:
    """A scheme's steps, and how to pull the suffix rows `[M * S, Hq, D]` from their outputs."""

    steps: list[Step]
    suffix_rows: Callable[[list[torch.Tensor]], torch.Tensor]


def scheme_run(scheme: str, case: SharedPrefixCase, backend: str) -> SchemeRun:
    """The steps of `scheme` for `case`; every step gets its own backend so its plan persists."""
    p, s, m, ps = case.prefix_len, case.suffix_len, case.num_requests, case.page_size
    device = case.kv_cache.device
    suffixes = case.q_suffix.flatten(0, 1)

    def step(
        q: torch.Tensor, name: str, qo: list[int], kv: list[int], tables: Any, **kw: Any
    ) -> Step:
        layout = build_scheme_layout(name, qo, kv, tables, ps, device=device, **kw)
        return Step(make_scheme_backend(backend), q, layout)

    if scheme == "naive":
        q = torch.cat([torch.cat([case.q_prefix, case.q_suffix[r]]) for r in range(m)])
        only = step(q, "naive", [p + s] * m, [p + s] * m, case.tables)
        return SchemeRun([only], lambda outs: outs[0].unflatten(0, (m, p + s))[:, p:].flatten(0, 1))
    ragged_q = torch.cat([case.q_prefix, suffixes])
    ragged_lens = ([p + s] + [s] * (m - 1), [p + s] * m)
    if scheme == "split":
        first = step(ragged_q[: p + s], "split", [p + s], [p + s], case.tables[:1])
        rest = step(suffixes[s:], "split", [s] * (m - 1), [p + s] * (m - 1), case.tables[1:])
        return SchemeRun([first, rest], lambda outs: torch.cat([outs[0][p:], outs[1]]))
    if scheme == "cascade":
        prefix = step(case.q_prefix, "naive", [p], [p], case.tables[:1])
        groups = {"groups": [list(range(m))], "shared_num_pages": [p // ps]}
        suffix = step(suffixes, "cascade", [s] * m, [p + s] * m, case.tables, **groups)
        return SchemeRun([prefix, suffix], lambda outs: outs[1])
    extra: dict[str, Any] = {}
    if scheme in ("multi_item", "custom_mask"):
        extra = {"groups": [list(range(m))], "prefix_lens": [p]}
    only = step(ragged_q, scheme, *ragged_lens, case.tables, **extra)
    return SchemeRun([only], lambda outs: outs[0][p:])


def run_scheme(run: SchemeRun, kv_cache: torch.Tensor, sm_scale: float) -> list[torch.Tensor]:
    """Every step's attention output, in order."""
    outs = []
    for st in run.steps:
        out = st.backend.forward(st.q, kv_cache, st.layout, sm_scale=sm_scale)
        assert isinstance(out, torch.Tensor)
        outs.append(out)
    return outs


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Refuse to time a scheme whose suffix outputs differ from naive's."""
    diff = (got.float() - want.float()).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{name}: suffix outputs differ from naive's by {diff:.2e} > {tol}")


def bench_cell(p: int, s: int, m: int, cfg: BenchConfig) -> dict[str, Any]:
    """Time every scheme on one cell; returns the JSON record."""
    case = make_case(p, s, m, cfg, seed=p * 1000 + s * 10 + m)
    runs = {scheme: scheme_run(scheme, case, cfg.backend) for scheme in SCHEMES}
    fns = {k: partial(run_scheme, run, case.kv_cache, cfg.sm_scale) for k, run in runs.items()}
    want = runs["naive"].suffix_rows(fns["naive"]())
    for scheme, run in runs.items():
        _check(scheme, run.suffix_rows(fns[scheme]()), want, cfg.tolerance)
    ms = median_ms(fns, cfg)
    auto = choose_scheme(BatchShape(p, s, m, cfg.backend))
    return {
        "P": p,
        "S": s,
        "M": m,
        "backend": cfg.backend,
        "decode": False,
        "ms": ms,
        "auto": auto,
        "auto_within_10pct": ms[auto] <= 1.1 * min(ms.values()),
    }


def run_prefill_schemes_bench(
    quick: bool, json_path: str | None, backend: str = "torch", *, grid: Grid | None = None
) -> int:
    """Print the per-cell table (and write JSON); returns 0, or 1 if `auto` missed a cell.

    The torch backend runs a scaled-down grid on CPU in float32; any other backend runs the
    seed's grid on CUDA in fp16. `grid` = (P values, S values, M values) overrides either.
    """
    cfg = bench_config(backend, quick)
    if grid is None:
        grid = GPU_GRID if backend != "torch" else CPU_QUICK_GRID if quick else CPU_GRID
    _print_header(cfg, grid)
    cells = []
    for p in grid[0]:
        for s in grid[1]:
            for m in grid[2]:
                cells.append(bench_cell(p, s, m, cfg))
                print(f"P={p} S={s} M={m}: done", flush=True)
    print(table(cells))
    write_json(json_path, cells)
    return 0 if all(c["auto_within_10pct"] for c in cells) else 1


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
        "(x) = speedup over naive; attention only, layouts and KV built before timing",
        flush=True,
    )


def _grid_text(grid: Grid) -> str:
    return " x ".join(f"{k}{{{', '.join(map(str, v))}}}" for k, v in zip("PSM", grid, strict=True))


def table(cells: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown table of `bench_cell` records: ms (speedup over naive) per scheme, `auto`."""
    rows = []
    for c in cells:
        ms = c["ms"]
        timed = [f"{ms[k]:.3f} ({ms['naive'] / ms[k]:.2f}x)" for k in SCHEMES]
        ok = "yes" if c["auto_within_10pct"] else "no"
        rows.append([c["P"], c["S"], c["M"], *timed, c["auto"], ok])
    return format_table(["P", "S", "M", *SCHEMES, "auto", "within 10%"], rows)
