"""Decode steps, one of the model's CPU kernels on and off alternating, on the real engine.

    python -m cachesvc.bench.step.linear [--switch linear|elementwise] [--threads 1]
        [--batches 1,4,16] [--contexts 128,1024] [--steps 6] [--rounds 4]
        [--dtype float32|bfloat16] [--json FILE]

For each cell (batch x context) a real `Engine` (SmolLM2-135M, decode attention in place) gets
`batch` requests of random `context`-token prompts and steps until all decode; then rounds of
`steps` decode steps alternate, on the same requests, so the ratio is of one sitting:
`--switch linear` (the default) the model's matmuls on the packed-panel kernel
(`LlamaModel.native_linear`, path "kernel") and on `F.linear` ("f_linear"); `--switch
elementwise` its norms, RoPE and SwiGLU on the fused kernels (`LlamaModel.native_elementwise`,
"fused") and on torch's ops ("torch_ops"); the KV write is on its kernel in both. Each step is
split by phase (`step_phases`); the floor is `cachesvc bench step`'s (weights and KV over the copy
bandwidth measured in the same run). Fidelity is the tests' (`tests/workers/model/test_llama.py`
against Hugging Face on either path), not this bench's.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from cachesvc.bench.step.flags import int_list
from cachesvc.bench.step.phases import PhaseClock, instrument
from cachesvc.bench.step.run import (
    copy_bandwidth_gb_s,
    decode_max_tokens,
    kv_bytes_per_token,
    start_decoding,
    weight_bytes,
)
from cachesvc.workloads.table import format_table, write_json

# --switch: the model's attribute it flips, and the names of its paths (on, off).
SWITCHES = {
    "linear": ("native_linear", ("kernel", "f_linear")),
    "elementwise": ("native_elementwise", ("fused", "torch_ops")),
}


@dataclass(frozen=True)
class DecodeLinearArgs:
    """What the bench runs; the flags of the same names."""

    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (128, 1024)
    threads: int = 1
    steps: int = 6  # timed decode steps a round
    rounds: int = 4  # rounds of each path
    dtype: str = "float32"
    switch: str = "linear"
    json_path: str | None = None

    @property
    def paths(self) -> tuple[str, str]:
        return SWITCHES[self.switch][1]


@dataclass(frozen=True)
class _Env:
    """What every cell shares: the phase clock and the floor's terms."""

    clock: PhaseClock
    bandwidth_gb_s: float
    weight_bytes: int
    kv_bytes_per_token: int


def _time_cell(engine: Any, clock: PhaseClock, batch: int, args: DecodeLinearArgs) -> dict:
    """Per path, every timed step's phases; rounds of the paths alternate."""
    model = engine.runner.model
    attribute, (on, _) = SWITCHES[args.switch]
    per_path: dict[str, list[dict[str, float]]] = {p: [] for p in args.paths}
    try:
        for _ in range(args.rounds):
            for path in args.paths:
                setattr(model, attribute, path == on)
                engine.step()  # untimed: the first step after a switch pays for the switch
                clock.take()
                for _ in range(args.steps):
                    assert len(engine.step()) == batch, "every request decodes one token a step"
                    per_path[path].append(clock.take())
    finally:
        setattr(model, attribute, True)
    return per_path


def _path_summary(samples: list[dict[str, float]], floor_ms: float) -> dict[str, float]:
    step = 1e3 * statistics.median(s["step"] for s in samples)
    return {
        "step_ms": step,
        "weights_ms": 1e3 * statistics.median(s["weights"] for s in samples),
        "weights_ms_mean": 1e3 * statistics.fmean(s["weights"] for s in samples),
        "floor_ratio": step / floor_ms,
    }


def _cell(engine: Any, batch: int, context: int, args: DecodeLinearArgs, env: _Env) -> dict:
    budget = engine.config.max_num_batched_tokens
    decode_tokens = args.rounds * len(args.paths) * (args.steps + 1) + 1
    max_tokens = decode_max_tokens(batch, context, decode_tokens, budget)
    generated = start_decoding(engine, batch, context, max_tokens, batch * 7919 + context)
    mid = decode_tokens // 2  # the KV read at the middle of the timed steps
    kv = sum(context + n + mid for n in generated.values()) * env.kv_bytes_per_token
    floor_ms = (env.weight_bytes + kv) / (env.bandwidth_gb_s * 1e9) * 1e3
    samples = _time_cell(engine, env.clock, batch, args)
    for rid in generated:
        engine.abort(rid)
    steps, (on, off) = args.steps, args.paths

    def by_round(phase: str) -> list[float]:  # each round's on / off ratio of the phase's median
        return [
            statistics.median(s[phase] for s in samples[on][r : r + steps])
            / statistics.median(s[phase] for s in samples[off][r : r + steps])
            for r in range(0, len(samples[on]), steps)
        ]

    weights_by_round, step_by_round = by_round("weights"), by_round("step")
    return {
        "batch": batch,
        "context": context,
        "floor_ms": floor_ms,
        "paths": {p: _path_summary(s, floor_ms) for p, s in samples.items()},
        "weights_ratio_by_round": weights_by_round,
        "weights_ratio": statistics.median(weights_by_round),
        "step_ratio_by_round": step_by_round,
        "step_ratio": statistics.median(step_by_round),
    }


def run(args: DecodeLinearArgs) -> dict[str, Any]:
    """Run every cell, print the table, write the JSON; returns the report."""
    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.kernels.fused import load as fused_built
    from workers.kernels.linear import load as linear_built

    cells = [(b, c) for c in args.contexts for b in args.batches]
    tokens = max(b * (c + 2 * args.rounds * (args.steps + 1) + b + 8) for b, c in cells)
    config = EngineConfig(num_blocks=tokens // 16 + 64, num_threads=args.threads, dtype=args.dtype)
    engine = Engine(config)
    env = _Env(
        PhaseClock(),
        copy_bandwidth_gb_s(),
        weight_bytes(engine.runner.model),
        kv_bytes_per_token(engine),
    )
    with instrument(engine, env.clock, [engine.runner.backend]):
        records = [_cell(engine, b, c, args, env) for b, c in cells]
    report = {
        "cells": records,
        "copy_bandwidth_gb_s": env.bandwidth_gb_s,
        "weights_bytes": env.weight_bytes,
        "dtype": args.dtype,
        "switch": args.switch,
        "paths": list(args.paths),
        "threads": torch.get_num_threads(),
        "kernel_built": linear_built() if args.switch == "linear" else fused_built(),
        "steps_per_round": args.steps,
        "rounds": args.rounds,
    }
    _print(report)
    write_json(args.json_path, report)
    return report


def _print(report: dict[str, Any]) -> None:
    on, off = report["paths"]
    headers = ["batch", "context", "floor ms", f"{on} step ms", f"{off} step ms"]
    headers += [f"{on} weights ms", f"{off} weights ms", f"weights {on} / {off}"]
    headers += [f"step {on} / {off}", f"{on} step / floor"]
    rows = []
    for r in report["cells"]:
        a, b = r["paths"][on], r["paths"][off]
        rows.append(
            [r["batch"], r["context"], r["floor_ms"], a["step_ms"], b["step_ms"]]
            + [a["weights_ms"], b["weights_ms"], r["weights_ratio"], r["step_ratio"]]
            + [a["floor_ratio"]]
        )
    print(format_table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.step.linear")
    parser.add_argument("--batches", type=int_list, default=DecodeLinearArgs.batches)
    parser.add_argument("--contexts", type=int_list, default=DecodeLinearArgs.contexts)
    parser.add_argument("--threads", type=int, default=DecodeLinearArgs.threads)
    parser.add_argument("--steps", type=int, default=DecodeLinearArgs.steps)
    parser.add_argument("--rounds", type=int, default=DecodeLinearArgs.rounds)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--switch", choices=tuple(SWITCHES), default=DecodeLinearArgs.switch)
    parser.add_argument("--json", dest="json_path")
    run(DecodeLinearArgs(**vars(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
