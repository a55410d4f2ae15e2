"""`cachesvc bench step`: one decode step of the real engine, split by phase, beside its floor.

For each cell (batch x context) a real `Engine` gets `batch` requests with random prompts of
`context` tokens and steps until all are decoding; then rounds of `steps` decode steps are
timed, alternating decode attention in place (the CPU kernel) and the gather path it replaced,
on the same requests, so the ratio is of one sitting. Each step is split by phase
(`step_phases`), and the host's share of it (everything but the model) is added up with the
stream deltas the worker's actor would build and pickle for Ray from the step's outputs. The
memory floor is the bytes the step must read (the weights the matmuls stream, every sequence's
KV in every layer) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import collections
import pickle
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cachesvc.bench.step.phases import PHASES, PhaseClock, instrument
from cachesvc.bench.step.report import print_report
from cachesvc.workloads.table import write_json

GRID = ((1, 4, 16, 64), (128, 1024, 4096))
QUICK_GRID = ((1, 4), (128, 1024))
# Cells whose KV would pass this are left out (64 x 4K of SmolLM2 is 12 GB), and said so.
MAX_KV_BYTES = 4 << 30
PATHS = ("in_place", "gather")


@dataclass(frozen=True)
class StepBenchArgs:
    """What `cachesvc bench step` runs; the flags of the same names."""

    json_path: str | None = None
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    threads: int | None = None
    dtype: str | None = None  # the weights' and KV's (None: float32)
    steps: int | None = None  # timed decode steps a round (default 8, quick 4)
    rounds: int | None = None  # rounds of each path (default 5, quick 3)
    grid: tuple[Sequence[int], Sequence[int]] | None = None
    ray_stream: bool = False  # instead: one step's deltas through a local Ray actor
    shared_prefix: int = 0  # tokens every prompt of a cell starts with (the rest random)

    def __post_init__(self) -> None:
        for name in ("threads", "steps", "rounds"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        if self.grid is not None and not all(n >= 1 for axis in self.grid for n in axis):
            raise ValueError("--batches and --contexts take positive numbers")
        if self.shared_prefix < 0:
            raise ValueError(f"--shared-prefix must be 0 or more, got {self.shared_prefix}")


def copy_bandwidth_gb_s(mb: int = 256, repeats: int = 7) -> float:
    """Copy bandwidth (STREAM's convention: bytes read + written, over the time), median."""
    src = torch.ones(mb << 18)  # float32: mb MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step streams: every layer and the LM head; of the embedding
    only as many rows as tokens (nothing), unless the LM head is the embedding itself."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        embed = model.embed_tokens
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V of one token in all layers."""
    cache = engine.runner.kv_caches[0]
    block_bytes = cache[0].numel() * cache.element_size()  # [2, block, Hk, D] of one layer
    return block_bytes // engine.config.block_size * len(engine.runner.kv_caches)


def _scheme_backends(inner: str) -> dict[str, Any]:
    from workers.attention.schemes import SchemeBackend
    from workers.attention.torch_backend import TorchBackend

    if inner != "torch":
        raise ValueError("bench step compares the torch backend's decode paths")
    return {
        "in_place": SchemeBackend(TorchBackend(), TorchBackend()),
        "gather": SchemeBackend(
            TorchBackend(decode_in_place=False), TorchBackend(decode_in_place=False)
        ),
    }


def decode_max_tokens(batch: int, context: int, decode_tokens: int, budget: int) -> int:
    """Tokens a request may generate: the timed decode, plus what it decodes while the last
    prompts of its batch are still being computed (at most one token per step of the fill)."""
    return decode_tokens + -(-batch * context // budget) + batch


def start_decoding(
    engine: Any, batch: int, context: int, max_tokens: int, seed: int, shared: int = 0
) -> dict[str, int]:
    """Add `batch` requests with random prompts of `context` tokens, the first `shared` of them
    the same in every prompt, and step until each has its first token (all are decoding then);
    returns the tokens each has generated, by id."""
    from workers.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    # Avoid the low ids, which hold special tokens in most vocabularies.
    prompts = torch.randint(min(100, vocab // 2), vocab, (batch, context), generator=gen)
    prompts[:, :shared] = prompts[0, :shared]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    generated = {engine.add_request(p, params)[0]: 0 for p in prompts.tolist()}
    while not all(generated.values()):
        for out in engine.step():
            generated[out.request_id] = len(out.token_ids)
    return generated


@dataclass(frozen=True)
class _Timing:
    steps: int  # timed decode steps a round
    rounds: int  # rounds of each path

    @property
    def decode_tokens(self) -> int:
        """Tokens each request decodes once all are decoding: an untimed step of each path,
        then the rounds, and one to spare."""
        return len(PATHS) * (1 + self.rounds * self.steps) + 1


def _stream(outputs: list[Any], sent: dict[str, dict[int, int]]) -> int:
    """What the worker's actor does with a step's outputs: one stream delta each, pickled as
    Ray pickles each item a streaming call yields; returns the bytes (kept, so nothing is
    optimized away)."""
    from workers.deltas import stream_delta

    return sum(
        len(pickle.dumps(stream_delta(out, out.request_id, 1, sent[out.request_id], "w"), 5))
        for out in outputs
    )


def _time_cell(
    engine: Any, backends: dict[str, Any], clock: PhaseClock, batch: int, timing: _Timing
) -> dict[str, list[dict[str, float]]]:
    """Per path, the phases of every timed step (and of its stream deltas); rounds of each path
    alternate."""
    steps, rounds = timing.steps, timing.rounds
    per_path: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    sent: dict[str, dict[int, int]] = collections.defaultdict(dict)
    for path in PATHS:  # one untimed step each: the first call of a path builds its tables
        engine.runner.backend = backends[path]
        _stream(engine.step(), sent)
    for _ in range(rounds):
        for path in PATHS:
            engine.runner.backend = backends[path]
            clock.take()
            for _ in range(steps):
                outputs = engine.step()
                assert len(outputs) == batch, "every request decodes one token a step"
                clock.start("stream")
                _stream(outputs, sent)
                clock.stop("stream")
                per_path[path].append(clock.take())
    return per_path


def _summary(samples: list[dict[str, float]], floor_ms: float) -> dict[str, Any]:
    """Median step, mean phases (means add up: phases + other = step, in the mean too)."""
    keys = (*PHASES, "other", "step", "stream", "host")
    ms = {k: 1e3 * statistics.fmean(s[k] for s in samples) for k in keys}
    step_ms = 1e3 * statistics.median(s["step"] for s in samples)
    return {
        "step_ms": step_ms,
        "step_ms_mean": ms.pop("step"),
        "other_ms": ms.pop("other"),
        "stream_ms": ms.pop("stream"),
        "host_ms": ms.pop("host"),
        "host_ms_median": 1e3 * statistics.median(s["host"] for s in samples),
        "host_cpu_ms_median": 1e3 * statistics.median(s["host_cpu"] for s in samples),
        "phases_ms": ms,
        "floor_ratio": step_ms / floor_ms,
    }


@contextmanager
def _model_path(args: StepBenchArgs) -> Iterator[str | None]:
    if not args.tiny:
        yield args.model
        return
    from workers.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-") as tmp:
        folder = Path(tmp) / "tiny-llama"
        yield str(write_tiny_model(folder, vocab_size=512, max_position_embeddings=8192))


def _cells(args: StepBenchArgs) -> list[tuple[int, int]]:
    batches, contexts = args.grid or (QUICK_GRID if args.quick else GRID)
    return [(b, c) for c in contexts for b in batches]


def run_step_bench(args: StepBenchArgs) -> int:
    """Print the table (and write JSON); returns 0."""
    if args.ray_stream:
        from cachesvc.bench.step.run.stream import run_stream_bench

        batches = args.grid[0] if args.grid else (16, 64, 256)
        return run_stream_bench(batches, args.steps or 20, args.json_path)
    from workers.attention.paged_decode import load as kernel_built
    from workers.config import EngineConfig
    from workers.engine.engine import Engine

    steps = args.steps or (4 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 5)
    timing = _Timing(steps, rounds)
    with _model_path(args) as model:
        dtype = args.dtype or "float32"
        probe = Engine(
            EngineConfig(model=model, num_blocks=16, num_threads=args.threads, dtype=dtype)
        )
        config = probe.config

        def tokens(cell: tuple[int, int]) -> int:  # the KV a cell's requests reach, in tokens
            b, c = cell
            return b * (
                c + decode_max_tokens(b, c, timing.decode_tokens, config.max_num_batched_tokens)
            )

        per_token = kv_bytes_per_token(probe)
        # A prompt is the shared prefix and at least one token of its own.
        short = [c for c in _cells(args) if c[1] <= args.shared_prefix]
        cells = [
            c for c in _cells(args) if tokens(c) * per_token <= MAX_KV_BYTES and c not in short
        ]
        skipped = [c for c in _cells(args) if c not in cells and c not in short]
        # Whole pages per request, and a little room.
        need = max(tokens(c) // config.block_size + 2 * c[0] for c in cells) + 16
        # Every request of the largest batch decodes in one step.
        max_seqs = max(config.max_num_seqs, max(b for b, _ in cells))
        engine = Engine(
            EngineConfig(
                model=model,
                num_blocks=need,
                num_threads=args.threads,
                dtype=dtype,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, max_seqs),
            ),
            loaded=probe.loaded,
            tokenizer=probe.tokenizer,
        )
        del probe
        report = _run_cells(engine, cells, timing, args.shared_prefix)
    report |= {
        "model": "tiny" if args.tiny else str(engine.loaded.path.name),
        "dtype": engine.config.dtype,
        "threads": torch.get_num_threads(),
        "kernel_built": kernel_built(),
        "steps_per_round": steps,
        "rounds": rounds,
        "shared_prefix": args.shared_prefix,
        "skipped_cells": [{"batch": b, "context": c, "why": "KV over 4 GiB"} for b, c in skipped]
        + [{"batch": b, "context": c, "why": "no longer than the shared prefix"} for b, c in short],
    }
    print_report(report)
    write_json(args.json_path, report)
    return 0


def _run_cells(
    engine: Any, cells: list[tuple[int, int]], timing: _Timing, shared: int
) -> dict[str, Any]:
    backends = _scheme_backends(engine.config.attention_backend)
    clock = PhaseClock()
    bandwidth = copy_bandwidth_gb_s()
    weights = weight_bytes(engine.runner.model)
    per_token = kv_bytes_per_token(engine)
    records = []
    with instrument(engine, clock, list(backends.values())):
        for batch, context in cells:
            budget = engine.config.max_num_batched_tokens
            max_tokens = decode_max_tokens(batch, context, timing.decode_tokens, budget)
            seed = batch * 7919 + context
            generated = start_decoding(engine, batch, context, max_tokens, seed, shared)
            # The KV read at the middle of the timed steps, in every layer; a shared prefix's
            # once (what decode over it must read at least, as cascade attention does).
            mid = len(PATHS) * (1 + timing.rounds * timing.steps) // 2
            own = sum(context - shared + n + mid for n in generated.values())
            kv = (shared + own) * per_token
            floor_ms = (weights + kv) / (bandwidth * 1e9) * 1e3
            samples = _time_cell(engine, backends, clock, batch, timing)
            for rid in generated:
                engine.abort(rid)
            paths = {p: _summary(s, floor_ms) for p, s in samples.items()}
            # Each round's ratio of medians: a co-tenant's burst then skews one round, not all.
            by_round = [
                statistics.median(s["step"] for s in samples["in_place"][r : r + timing.steps])
                / statistics.median(s["step"] for s in samples["gather"][r : r + timing.steps])
                for r in range(0, len(samples["gather"]), timing.steps)
            ]
            records.append(
                {
                    "batch": batch,
                    "context": context,
                    "weights_bytes": weights,
                    "kv_bytes": kv,
                    "floor_ms": floor_ms,
                    "paths": paths,
                    "in_place_over_gather": paths["in_place"]["step_ms"]
                    / paths["gather"]["step_ms"],
                    "round_ratios": by_round,
                    "in_place_over_gather_by_round": statistics.median(by_round),
                }
            )
            print(f"batch {batch} context {context}: done", flush=True)
    return {
        "copy_bandwidth_gb_s": bandwidth,
        "kv_bytes_per_token": per_token,
        "phases": PHASES,
        "cells": records,
    }
