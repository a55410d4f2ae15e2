"""Decode attention alone: the paged-decode kernel over a pool the size of a served one, in
nanoseconds a token and layer, with the pages of each request in a row or scattered, and with
the context in cache for comparison.

    python -m cachesvc.bench.step.attention [--batches 1,4,16] [--contexts 128,1024]
        [--threads 1,2] [--rows 1] [--repeats 7] [--json FILE]

Per cell: `batch` requests of `context` tokens, SmolLM2-135M's shape (30 layers, 3 KV heads of 64
and 3 query heads each, pages of 16 tokens, float32), one call a layer over that layer's cache as
the engine makes them; the fastest of `repeats` passes over the 30 layers. "contiguous": the
requests' pages one after another; "scattered": pages drawn at random from a pool of
`pool_blocks` (a served worker's pool holds 4 GiB, and a request's pages lie wherever blocks were
free). "in cache": one layer's cache holding just the cell's pages, called for all 30 layers, so
while it fits the CPU's caches (1.5 MB a 1,024-token request) a pass costs the arithmetic.
With `--rows R` each request has R query rows over its pages, as a cascade group's rows over
their shared prefix (R x 3 query heads a KV head). Correctness is the kernel's tests', not this
bench's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from cachesvc.bench.step.flags import int_list
from cachesvc.workloads.table import format_table, write_json

LAYERS, PAGE, KV_HEADS, GROUP, HEAD_DIM = 30, 16, 3, 3, 64


@dataclass(frozen=True)
class AttentionArgs:
    """What the bench runs; the flags of the same names."""

    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (128, 1024)
    threads: tuple[int, ...] = (1, 2)
    repeats: int = 7
    pool_blocks: int = 2048
    rows: int = 1  # query rows a request, all over its pages
    json_path: str | None = None


def _pass_s(
    caches: list[torch.Tensor], pages: torch.Tensor, batch: int, context: int, rows: int
) -> float:
    """Seconds of one call a layer for `batch` requests of `context` tokens over `pages`, each
    with `rows` query rows."""
    from workers.attention.paged_decode import paged_decode

    per = -(-context // PAGE)
    requests = torch.tensor(
        [[r * rows, r * per, context, rows] for r in range(batch)], dtype=torch.int64
    )
    q = torch.randn(batch * rows, KV_HEADS * GROUP, HEAD_DIM)
    out, lse = torch.empty_like(q), torch.empty(batch * rows, KV_HEADS * GROUP)
    start = time.perf_counter()
    for cache in caches:
        paged_decode(q, cache, pages, requests, HEAD_DIM**-0.5, out, lse)
    return time.perf_counter() - start


def _cell(
    pool: list[torch.Tensor], batch: int, context: int, repeats: int, rows: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    per = -(-context // PAGE)
    layouts = {
        "contiguous": torch.arange(batch * per, dtype=torch.int32),
        "scattered": torch.randperm(pool[0].shape[0], generator=gen)[: batch * per].to(torch.int32),
    }
    # One layer's cache of the cell's pages, called for every layer: in the CPU's caches
    # while it fits them (1.5 MB a 1,024-token request).
    own = torch.randn(batch * per, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    best = {name: float("inf") for name in (*layouts, "in_cache")}
    for _ in range(repeats):
        for name, pages in layouts.items():
            best[name] = min(best[name], _pass_s(pool, pages, batch, context, rows))
        in_cache = _pass_s([own] * LAYERS, layouts["contiguous"], batch, context, rows)
        best["in_cache"] = min(best["in_cache"], in_cache)
    token_layers = batch * context * LAYERS
    return {name: 1e9 * s / token_layers for name, s in best.items()} | {
        "pass_ms": {name: 1e3 * s for name, s in best.items()}
    }


def run(args: AttentionArgs) -> dict[str, Any]:
    """Every cell, printed and written as JSON; returns the report."""
    from workers.attention.paged_decode import load
    from workers.kernels.host_tensor import host_zeros

    if not load():
        raise SystemExit("the paged-decode kernel does not build here: nothing to measure")
    if args.rows < 1:
        raise SystemExit(f"--rows must be at least 1, got {args.rows}")
    shape = (LAYERS, args.pool_blocks, 2, PAGE, KV_HEADS, HEAD_DIM)
    pool_all = host_zeros(shape, torch.float32)  # on huge pages, as the engine's cache
    pool_all.normal_(generator=torch.Generator().manual_seed(0))
    pool = list(pool_all.unbind(0))
    cells = []
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                for context in args.contexts:
                    if batch * -(-context // PAGE) > args.pool_blocks:
                        continue
                    cell = _cell(pool, batch, context, args.repeats, args.rows)
                    cells.append({"threads": threads, "batch": batch, "context": context} | cell)
    finally:
        torch.set_num_threads(before)
    headers = ["threads", "batch", "context", "contiguous ns", "scattered ns", "in cache ns"]
    headers += ["scattered / in cache"]
    table = [
        [c["threads"], c["batch"], c["context"], c["contiguous"], c["scattered"], c["in_cache"]]
        + [c["scattered"] / c["in_cache"]]
        for c in cells
    ]
    print(
        f"decode attention, {args.rows} query rows a request, ns a token and layer (fastest pass):"
    )
    print(format_table(headers, table))
    report = {"cells": cells, "pool_blocks": args.pool_blocks, "layers": LAYERS, "rows": args.rows}
    write_json(args.json_path, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.step.attention")
    parser.add_argument("--batches", type=int_list, default=AttentionArgs.batches)
    parser.add_argument("--contexts", type=int_list, default=AttentionArgs.contexts)
    parser.add_argument("--threads", type=int_list, default=AttentionArgs.threads)
    parser.add_argument("--repeats", type=int, default=AttentionArgs.repeats)
    parser.add_argument("--rows", type=int, default=AttentionArgs.rows)
    parser.add_argument("--pool-blocks", type=int, default=AttentionArgs.pool_blocks)
    parser.add_argument("--json", dest="json_path")
    run(AttentionArgs(**vars(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
