"""`cachesvc bench ...`: the benchmark suites' flags and dispatch (each prints ratios against a
baseline measured in the same run; heavy imports happen inside the suite that runs)."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.cli_serving import add_routing_bench_parser, run_routing_bench_command
from cachesvc.cli_types import CliError


def add_bench_parser(sub: Any) -> None:
    """Register `bench` and its suites on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks that print ratios against a baseline")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    eng = bench_sub.add_parser("engine", help="prefill/decode tokens/s vs Hugging Face")
    eng.add_argument("--json", dest="json_path", help="also write the results to this file")
    eng.add_argument("--quick", action="store_true", help="a small run, under a minute or two")
    eng.add_argument("--model", default=None)
    eng.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    eng.add_argument("--threads", type=int, default=None, help="torch CPU threads, both engines")
    for name, help_text in (
        ("prefill-schemes", "the seed's P x S x M grid: every shared-prefix prefill scheme"),
        ("decode-cascade", "cascade vs batch decode over shared prefixes"),
        ("prefix-cache", "TTFT and throughput: caching off, split, in-batch dedup"),
    ):
        b = bench_sub.add_parser(name, help=help_text)
        b.add_argument("--json", dest="json_path", help="also write the results to this file")
        b.add_argument("--quick", action="store_true", help="a small run, under a minute")
        b.add_argument("--backend", default="torch", help="attention backend (torch, flashinfer)")
        if name == "prefix-cache":
            b.add_argument("--model", default=None)
            b.add_argument("--groups", type=int, default=4, help="prefix groups")
            b.add_argument("--requests", type=int, default=4, help="requests per group")
            b.add_argument("--system-len", type=int, default=512, help="shared prefix tokens")
            b.add_argument("--question-len", type=int, default=32, help="own suffix tokens")
            b.add_argument("--output-len", type=int, default=16, help="generated tokens")

    tiers = bench_sub.add_parser("tiers", help="TTFT with the prefix in each tier vs recompute")
    tiers.add_argument("--json", dest="json_path", help="also write the results to this file")
    tiers.add_argument("--quick", action="store_true", help="contexts 256/512 (else 1K/4K/8K)")
    tiers.add_argument("--model", default=None)
    tiers.add_argument("--redis-url", default=None, help="default: a local redis-server")
    tiers.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_routing_bench_parser(bench_sub)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the suite `args.suite`; returns the exit status."""
    if args.suite == "routing":
        return run_routing_bench_command(args)
    if args.suite == "engine":
        from cachesvc.bench.engine import run_engine_bench

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return run_engine_bench(
            model=args.model, quick=args.quick, json_path=args.json_path, with_hf=not args.no_hf
        )
    if args.suite == "prefill-schemes":
        from cachesvc.bench.prefill_schemes import run_prefill_schemes_bench

        return run_prefill_schemes_bench(args.quick, args.json_path, backend=args.backend)
    if args.suite == "decode-cascade":
        from cachesvc.bench.decode_cascade import run_decode_cascade_bench

        return run_decode_cascade_bench(args.quick, args.json_path, backend=args.backend)
    if args.suite == "tiers":
        from cachesvc.bench.tiers import run_tiers_bench

        return run_tiers_bench(args.model, args.quick, args.json_path, args.redis_url, args.threads)
    if args.suite == "prefix-cache":
        from cachesvc.bench.prefix_cache import run_prefix_cache_bench

        return run_prefix_cache_bench(args)
    raise CliError(f"unknown benchmark {args.suite!r}")
