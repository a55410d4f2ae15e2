"""`cachesvc bench routing`: its flags and dispatch, beside `bench.py` (the bench itself,
`cachesvc.bench.routing`, is imported only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any


def add_routing_bench_parser(bench_sub: Any) -> None:
    """Register `bench routing` on the bench suites' subparsers."""
    from cachesvc.workloads.sessions import TraceScale

    b = bench_sub.add_parser(
        "routing", help="every routing policy on one workload: hit ratio, TTFT, imbalance"
    )
    b.add_argument("--workers", type=int, default=2)
    b.add_argument(
        "--workload",
        default="groups",
        choices=("groups", "multiturn", "trace", "hot-prefix", "all"),
        help="hot-prefix: one long context forked into many requests; affinity only, load "
        "only and load-aware with pulls between workers",
    )
    b.add_argument("--trace", help="a Mooncake JSONL trace for --workload trace")
    b.add_argument("--json", dest="json_path", help="also write the results to this file")
    b.add_argument("--plot", dest="plot_path", help="also draw the results into this PNG")
    b.add_argument("--quick", action="store_true", help="a small run, a minute or two")
    b.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    b.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of a model")
    b.add_argument("--rate", type=float, default=None, help="arrivals per second")
    b.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per worker (default 128; 1024 with hot-prefix)",
    )
    d = TraceScale()
    b.add_argument(
        "--trace-block-tokens",
        type=int,
        default=d.block_tokens,
        help="tokens per trace hash id (512 in the trace)",
    )
    b.add_argument(
        "--trace-max-blocks", type=int, default=d.max_blocks, help="hash ids kept per request"
    )
    b.add_argument(
        "--trace-families",
        type=int,
        default=d.families,
        help="prefix families sampled (most frequent first hash ids)",
    )
    b.add_argument("--trace-requests", type=int, default=d.max_requests)
    b.add_argument(
        "--trace-duration",
        type=float,
        default=d.duration_s,
        help="seconds the replayed requests' arrivals span",
    )
    b.add_argument("--max-output", type=int, default=d.max_output, help="trace output tokens cap")


def run_routing_bench_command(args: argparse.Namespace) -> int:
    """Run `bench routing` with the parsed flags; returns the exit code."""
    from cachesvc.bench.routing import run_routing_bench
    from cachesvc.workloads.routing import RoutingBenchArgs
    from cachesvc.workloads.sessions import TraceScale

    scale = TraceScale(
        block_tokens=args.trace_block_tokens,
        max_blocks=args.trace_max_blocks,
        families=args.trace_families,
        max_requests=args.trace_requests,
        duration_s=args.trace_duration,
        max_output=args.max_output,
    )
    return run_routing_bench(
        RoutingBenchArgs(
            workers=args.workers,
            workload=args.workload,
            trace=args.trace,
            json_path=args.json_path,
            plot_path=args.plot_path,
            quick=args.quick,
            model=args.model,
            tiny=args.tiny,
            rate=args.rate,
            num_blocks=args.num_blocks,
            trace_scale=scale,
        )
    )
