"""The model's matmuls alone: the packed-panel kernel against `F.linear`, at decode's and
prefill's row counts, alternating passes in one process.

    python -m cachesvc.bench.step.matmuls [--rows 1,4,16,75,256,1075] [--threads 1,2]
        [--repeats 7] [--dtype float32|bfloat16] [--json FILE]

A pass is every layer's four matmuls (q/k/v, o, gate/up, down) of the default model (SmolLM2-135M)
on `rows` random input rows, plus the LM head at decode's row counts (at most 16: prefill asks
logits of its last rows only). Per cell the paths alternate, `repeats` passes each, and the
fastest pass of each is kept (the machine's other work only ever adds time). The kernel runs
twice: over packs on huge pages (what the model uses) and over the same packs on 4 KB pages.
The floor is the weights a pass streams over the copy bandwidth measured in the same run; past
a few rows a pass is arithmetic, not memory. Correctness is the kernel's tests' and the model's
against Hugging Face, not this bench's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cachesvc.bench.step.flags import int_list
from cachesvc.bench.step.run import copy_bandwidth_gb_s
from cachesvc.workloads.table import format_table, write_json

DECODE_ROWS = 16  # the LM head runs at most this many rows in a pass


@dataclass(frozen=True)
class MatmulsArgs:
    """What the bench runs; the flags of the same names."""

    rows: tuple[int, ...] = (1, 4, 16, 75, 256, 1075)
    threads: tuple[int, ...] = (1, 2)
    repeats: int = 7
    dtype: str = "float32"
    json_path: str | None = None


def _weights(model: Any) -> list[torch.Tensor]:
    layers = [
        w
        for layer in model.layers
        for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
    ]
    return layers + [model.lm_head_weight]


def _pass_s(weights: list[torch.Tensor], xs: list[torch.Tensor], packs: Any | None) -> float:
    """One pass's seconds: by the kernel over `packs` (a `PackedWeights`), or by `F.linear`."""
    start = time.perf_counter()
    for i, (w, x) in enumerate(zip(weights, xs, strict=True)):
        if packs is None:
            F.linear(x, w)
        else:
            packs.linear(str(i), x, w, None)
    return time.perf_counter() - start


def run(args: MatmulsArgs) -> dict[str, Any]:
    """Every cell, printed and written as JSON; returns the report."""
    from workers.kernels.linear import PackedWeights, load
    from workers.model.loader import load_model
    from workers.text.default_model import default_model_path

    if not load():
        raise SystemExit("the packed-panel kernel does not build here: nothing to compare")
    dtype = getattr(torch, args.dtype)
    model = load_model(default_model_path(), dtype=dtype).model
    weights = _weights(model)
    # The same packs on huge pages (what the model uses) and on torch's 4 KB pages.
    packs = {"kernel": PackedWeights(), "kernel_4k": PackedWeights(huge_pages=False)}
    for path_packs in packs.values():
        for i, w in enumerate(weights):
            path_packs.of(str(i), w)
    bandwidth = copy_bandwidth_gb_s()
    gen = torch.Generator().manual_seed(0)
    cells = []
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                used = weights if rows <= DECODE_ROWS else weights[:-1]
                xs = [torch.randn((rows, w.shape[1]), generator=gen).to(dtype) for w in used]
                best = {"kernel": float("inf"), "kernel_4k": float("inf"), "f_linear": float("inf")}
                for _ in range(args.repeats):
                    for path in best:
                        best[path] = min(best[path], _pass_s(used, xs, packs.get(path)))
                nbytes = sum(w.numel() * w.element_size() for w in used)
                cells.append(
                    {
                        "threads": threads,
                        "rows": rows,
                        "kernel_ms": 1e3 * best["kernel"],
                        "kernel_4k_ms": 1e3 * best["kernel_4k"],
                        "f_linear_ms": 1e3 * best["f_linear"],
                        "ratio": best["kernel"] / best["f_linear"],
                        "huge_over_4k": best["kernel"] / best["kernel_4k"],
                        "floor_ms": 1e3 * nbytes / (bandwidth * 1e9),
                        "weights_bytes": nbytes,
                    }
                )
    finally:
        torch.set_num_threads(before)
    report = {"cells": cells, "copy_bandwidth_gb_s": bandwidth, "dtype": args.dtype}
    headers = ["threads", "rows", "floor ms", "kernel ms", "kernel 4 KB pages ms", "F.linear ms"]
    headers += ["kernel / F.linear", "huge / 4 KB pages"]
    table = [
        [c["threads"], c["rows"], c["floor_ms"], c["kernel_ms"], c["kernel_4k_ms"]]
        + [c["f_linear_ms"], c["ratio"], c["huge_over_4k"]]
        for c in cells
    ]
    print(format_table(headers, table))
    write_json(args.json_path, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.step.matmuls")
    parser.add_argument("--rows", type=int_list, default=MatmulsArgs.rows)
    parser.add_argument("--threads", type=int_list, default=MatmulsArgs.threads)
    parser.add_argument("--repeats", type=int, default=MatmulsArgs.repeats)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", dest="json_path")
    run(MatmulsArgs(**vars(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
