"""`decode_cascade`: cascade decode against plain batch decode for N requests sharing a prefix.

Every request has the shared prefix P (cached, whole pages) and its own 128 cached tokens, and
decodes one token. Plain batch decode reads P once per request; cascade reads it once for all
(level 0) and each request's own tokens (level 1), then merges. `ideal` is the ratio of KV
tokens read, `N * (P + 128) / (P + N * 128)`, the speedup of a purely bandwidth-bound kernel.
The outputs of both are checked equal before timing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from cachesvc.bench.prefill_schemes import BenchConfig, bench_config, median_ms
from cachesvc.workloads.table import format_table, write_json
from workers.attention.schemes import (
    BatchShape,
    SchemeBackend,
    SchemeLayout,
    build_scheme_layout,
    choose_scheme,
    make_scheme_backend,
)

DecodeGrid = tuple[Sequence[int], Sequence[int]]
OWN_LEN = 128
GPU_GRID: DecodeGrid = ((1024, 8192, 32768), (8, 32, 128))
# Plain batch decode on the torch backend copies N * (P + 128) tokens: keep that under ~2 GB.
CPU_GRID: DecodeGrid = ((256, 1024, 4096), (8, 32, 64))
CPU_QUICK_GRID: DecodeGrid = ((256, 1024), (8, 32))


def _case(p: int, n: int, cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random q `[N, Hq, D]`, a filled cache, and tables: P's pages shared, 128 own tokens each."""
    gen = torch.Generator().manual_seed(p + n)
    ps = cfg.page_size
    shared, own = -(-p // ps), OWN_LEN // ps
    tables = [
        list(range(shared)) + list(range(shared + r * own, shared + (r + 1) * own))
        for r in range(n)
    ]
    shape = (shared + n * own, 2, ps, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.randn(shape, generator=gen)
    q = torch.randn(n, cfg.num_qo_heads, cfg.head_dim, generator=gen)
    return q.to(cfg.device, cfg.dtype), cache.to(cfg.device, cfg.dtype), tables


def _forward(
    backend: SchemeBackend, q: torch.Tensor, cache: torch.Tensor, layout: SchemeLayout, scale: float
) -> torch.Tensor:
    out = backend.forward(q, cache, layout, sm_scale=scale)
    assert isinstance(out, torch.Tensor)
    return out


def bench_cell(p: int, n: int, cfg: BenchConfig) -> dict[str, Any]:
    """Time batch decode and cascade decode on one cell; returns the JSON record."""
    if p % cfg.page_size:
        raise ValueError(f"prefix {p} must be whole pages of {cfg.page_size}")
    q, cache, tables = _case(p, n, cfg)
    kv_lens = [p + OWN_LEN] * n
    layouts = {
        "ragged": build_scheme_layout("ragged", [1] * n, kv_lens, tables, cfg.page_size),
        "cascade": build_scheme_layout(
            "cascade", [1] * n, kv_lens, tables, cfg.page_size,
            groups=[list(range(n))], shared_num_pages=[p // cfg.page_size],
        ),
    }  # fmt: skip
    fns = {
        k: partial(_forward, make_scheme_backend(cfg.backend), q, cache, lay, cfg.sm_scale)
        for k, lay in layouts.items()
    }
    diff = (fns["cascade"]() - fns["ragged"]()).float().abs().max().item()
    if not diff <= cfg.tolerance:
        raise AssertionError(f"cascade decode differs from batch decode by {diff:.2e}")
    ms = median_ms(fns, cfg)
    auto = choose_scheme(BatchShape(p, OWN_LEN, n, cfg.backend, decode=True))
    return {
        "P": p,
        "S": OWN_LEN,
        "M": n,
        "backend": cfg.backend,
        "decode": True,
        "ms": ms,
        "ideal_ratio": n * (p + OWN_LEN) / (p + n * OWN_LEN),
        "auto": auto,
        "auto_within_10pct": ms[auto] <= 1.1 * min(ms.values()),
    }


def run_decode_cascade_bench(
    quick: bool, json_path: str | None, backend: str = "torch", *, grid: DecodeGrid | None = None
) -> int:
    """Print the table (and write JSON); returns 0, or 1 if `auto` missed a cell.

    The torch backend runs a scaled-down grid on CPU in float32; any other backend the seed's
    grid (P 1K/8K/32K x N 8/32/128) on CUDA in fp16. `grid` = (P values, N values) overrides.
    """
    cfg = bench_config(backend, quick)
    if grid is None:
        grid = GPU_GRID if backend != "torch" else CPU_QUICK_GRID if quick else CPU_GRID
    scaled = "" if grid == GPU_GRID else " (SCALED from P{1024, 8192, 32768} x N{8, 32, 128})"
    print(
        f"decode cascade: backend {backend} on {cfg.device}, {str(cfg.dtype)[6:]}, heads "
        f"{cfg.num_qo_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, page {cfg.page_size}, "
        f"own tokens {OWN_LEN}\ngrid P{{{', '.join(map(str, grid[0]))}}} x "
        f"N{{{', '.join(map(str, grid[1]))}}}{scaled}; ms = median, attention of one layer",
        flush=True,
    )
    cells = [bench_cell(p, n, cfg) for p in grid[0] for n in grid[1]]
    print(table(cells))
    write_json(json_path, cells)
    return 0 if all(c["auto_within_10pct"] for c in cells) else 1


def table(cells: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown table of `bench_cell` records: batch and cascade ms, speedup, `auto`."""
    rows = [
        [
            c["P"],
            c["M"],
            f"{c['ms']['ragged']:.3f}",
            f"{c['ms']['cascade']:.3f}",
            c["ms"]["ragged"] / c["ms"]["cascade"],
            c["ideal_ratio"],
            c["auto"],
            "yes" if c["auto_within_10pct"] else "no",
        ]
        for c in cells
    ]
    headers = ["P", "N", "batch ms", "cascade ms", "speedup", "ideal", "auto", "within 10%"]
    return format_table(headers, rows)
