"""`cachesvc bench prefix-cache`: what prefix sharing buys on a shared-system-prompt workload.

G groups of R requests; each group shares a system prompt of `system_len` tokens, each request
adds its own question. All requests arrive at once. The same workload runs with caching off,
with across-request caching only (`split`: sharers wait one step for the cached prefix), with
in-batch dedup (`ragged`) and with the automatic scheme choice, on one loaded model in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from cachesvc.workloads.table import format_table, percentile, write_json

MODES = {
    "off": {"enable_prefix_caching": False},
    "split": {"prefill_scheme": "split"},
    "ragged": {"prefill_scheme": "ragged"},
    "auto": {"prefill_scheme": "auto"},
}


@dataclass(frozen=True)
class ModeResult:
    mode: str
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_tok_s: float
    computed_tokens: int
    cached_tokens: int
    wall_s: float


def workload(
    groups: int, per_group: int, system_len: int, question_len: int, vocab: int
) -> list[list[int]]:
    """Deterministic prompts: group g's system prompt, then each request's own question."""
    gen = torch.Generator().manual_seed(1234)
    prompts = []
    for _ in range(groups):
        system = torch.randint(100, vocab, (system_len,), generator=gen).tolist()
        for _ in range(per_group):
            prompts.append(
                system + torch.randint(100, vocab, (question_len,), generator=gen).tolist()
            )
    return prompts


def run_mode(
    mode: str, loaded: Any, tokenizer: Any, prompts: list[list[int]], output_len: int
) -> ModeResult:
    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    config = EngineConfig(max_num_batched_tokens=8192, kv_cache_mb=1024, **MODES[mode])  # type: ignore[arg-type]
    engine = Engine(config, loaded=loaded, tokenizer=tokenizer)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    ttfts = [o.ttft_ms or 0.0 for o in outs]
    return ModeResult(
        mode=mode,
        ttft_p50_ms=statistics.median(ttfts),
        ttft_p99_ms=percentile(ttfts, 99),
        throughput_tok_s=sum(len(o.token_ids) for o in outs) / wall,
        computed_tokens=sum(o.num_computed_tokens for o in outs),
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        wall_s=wall,
    )


def run_prefix_cache_bench(args: argparse.Namespace) -> int:
    """Print the table (and write JSON); returns the exit status."""
    from workers.model.loader import load_model
    from workers.text.tokenizer import Tokenizer

    if args.quick:
        args.groups, args.requests, args.system_len = 2, 4, 256
        args.question_len, args.output_len = 16, 8
    loaded = load_model(args.model)
    tokenizer = Tokenizer.from_path(loaded.path)
    prompts = workload(
        args.groups, args.requests, args.system_len, args.question_len, loaded.config.vocab_size
    )
    run_mode("ragged", loaded, tokenizer, prompts[:2], 2)  # warm-up, untimed
    results = [run_mode(m, loaded, tokenizer, prompts, args.output_len) for m in MODES]
    base = results[0]
    rows = [
        [
            r.mode,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            base.ttft_p50_ms / r.ttft_p50_ms,
            r.throughput_tok_s,
            r.throughput_tok_s / base.throughput_tok_s,
            r.computed_tokens,
            r.cached_tokens,
        ]
        for r in results
    ]
    print(
        f"\n{args.groups} groups x {args.requests} requests, system prompt {args.system_len}, "
        f"question {args.question_len}, output {args.output_len}, {loaded.path.name}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        format_table(
            [
                "mode",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "p50 speedup",
                "tok/s",
                "tok/s ratio",
                "computed",
                "cached",
            ],
            rows,
        )
    )
    write_json(
        args.json_path,
        {
            "suite": "prefix-cache",
            "workload": {
                "groups": args.groups,
                "requests": args.requests,
                "system_len": args.system_len,
                "question_len": args.question_len,
                "output_len": args.output_len,
            },
            "modes": [asdict(r) for r in results],
        },
    )
    return 0
