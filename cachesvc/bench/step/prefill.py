"""Prefill attention alone: the CPU prefill-attention kernel at a served step's shapes, in
milliseconds a call and arithmetic rate.

    python -m cachesvc.bench.step.prefill [--shapes 1050x1050,998x1050] [--threads 1,2]
        [--repeats 7] [--json FILE]

A shape `QxK` is a chunk of Q queries over K keys, bottom-right causal (the chunk's queries are
the last Q of K tokens), SmolLM2-135M's heads (9 query heads over 3 KV heads of 64, float32), one
call as the engine makes it for one request and layer. The defaults are what a two-core worker's
2,048-token steps hold on 1,050-token prompts: a whole prompt, a prompt's tail after 52 cached
tokens, half a step over a 2,048-token context, and a whole step's square. The rate counts the
multiply-adds of both products over the keys each query sees (4 x head dim flops a visible pair
and head), the fastest of `repeats` timed calls. Correctness is the kernel's tests', not this
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

QUERY_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """`1050x1050,998x1050` as ((1050, 1050), (998, 1050))."""
    out = []
    for part in text.split(","):
        q, _, k = part.strip().partition("x")
        if not (q.isdigit() and k.isdigit()) or int(q) < 1 or int(k) < int(q):
            raise argparse.ArgumentTypeError(f"a shape is QxK with 1 <= Q <= K, got {part!r}")
        out.append((int(q), int(k)))
    return tuple(out)


@dataclass(frozen=True)
class PrefillArgs:
    """What the bench runs; the flags of the same names."""

    shapes: tuple[tuple[int, int], ...] = ((1050, 1050), (998, 1050), (1024, 2048), (2048, 2048))
    threads: tuple[int, ...] = (2,)
    repeats: int = 7
    json_path: str | None = None


def visible_pairs(queries: int, keys: int) -> int:
    """(query, key) pairs a bottom-right causal chunk attends over."""
    shift = keys - queries
    return sum(min(keys, i + shift + 1) for i in range(queries))


def _cell(queries: int, keys: int, repeats: int) -> dict[str, Any]:
    from workers.attention.prefill_attention import prefill_attention

    gen = torch.Generator().manual_seed(queries * 7919 + keys)
    q = torch.randn(queries, QUERY_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(keys, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(keys, KV_HEADS, HEAD_DIM, generator=gen)
    prefill_attention(q, k, v, HEAD_DIM**-0.5, True)  # warm: the pool's threads, the heap
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        prefill_attention(q, k, v, HEAD_DIM**-0.5, True)
        best = min(best, time.perf_counter() - start)
    flops = 4 * HEAD_DIM * QUERY_HEADS * visible_pairs(queries, keys)
    return {"ms": 1e3 * best, "gflops": flops / best / 1e9}


def run(args: PrefillArgs) -> dict[str, Any]:
    """Every cell, printed and written as JSON; returns the report."""
    from workers.attention.prefill_attention import load

    if not load():
        raise SystemExit("the prefill-attention kernel does not build here: nothing to measure")
    cells = []
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for queries, keys in args.shapes:
                cell = _cell(queries, keys, args.repeats)
                cells.append({"threads": threads, "queries": queries, "keys": keys} | cell)
    finally:
        torch.set_num_threads(before)
    headers = ["threads", "queries", "keys", "ms a call", "GFLOP/s"]
    table = [[c["threads"], c["queries"], c["keys"], c["ms"], c["gflops"]] for c in cells]
    print("prefill attention, one causal chunk of one request and layer (fastest call):")
    print(format_table(headers, table))
    report = {"cells": cells, "heads": [QUERY_HEADS, KV_HEADS], "head_dim": HEAD_DIM}
    write_json(args.json_path, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.step.prefill")
    parser.add_argument("--shapes", type=_shapes, default=PrefillArgs.shapes)
    parser.add_argument("--threads", type=int_list, default=PrefillArgs.threads)
    parser.add_argument("--repeats", type=int, default=PrefillArgs.repeats)
    parser.add_argument("--json", dest="json_path")
    run(PrefillArgs(**vars(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
