"""Command-line pieces of the serving layer, registered by `cachesvc.cli`: the router's
scale-out and operations flags on `serve`, `demo-serve`, and `bench routing`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of `cachesvc serve` for a shared index, metrics, logs and queue limits."""
    serve.add_argument(
        "--redis-url",
        default=None,
        help="share the prefix index through Redis (redis://host:port/db), so several routers "
        "route alike and a restarted router is not blind",
    )
    serve.add_argument(
        "--redis-namespace",
        default="cachesvc",
        help="key prefix in Redis: the same for routers of the same workers, distinct otherwise",
    )
    serve.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port"
    )
    serve.add_argument(
        "--max-queued-per-worker",
        type=int,
        default=None,
        help="refuse (RESOURCE_EXHAUSTED) when every worker has this many requests",
    )
    serve.add_argument(
        "--max-inflight", type=int, default=1024, help="requests the router takes at once"
    )
    serve.add_argument("--log-format", default="text", choices=("text", "json"))


def router_options(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `add_serve_flags` added."""
    return {
        "redis_url": args.redis_url,
        "redis_namespace": args.redis_namespace,
        "metrics_port": args.metrics_port,
        "max_queued_per_worker": args.max_queued_per_worker,
        "max_inflight": args.max_inflight,
    }


def add_demo_serve_parser(
    sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    demo = sub.add_parser(
        "demo-serve",
        help="start the service (router + workers), send a demo workload through gRPC, stop",
    )
    demo.add_argument("--workers", type=int, default=2, help="worker actors (at most 2 on CPU)")
    demo.add_argument("--max-tokens", type=int, default=24)
    add_engine_args(demo)


def run_demo_serve_command(args: argparse.Namespace, engine: Any) -> int:
    from cachesvc.demo_serve import run_demo_serve

    return run_demo_serve(engine, num_workers=args.workers, max_tokens=args.max_tokens)


def add_routing_bench_parser(bench_sub: Any) -> None:
    from cachesvc.bench.workloads import TraceScale

    b = bench_sub.add_parser(
        "routing", help="every routing policy on one workload: hit ratio, TTFT, imbalance"
    )
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--workload", default="groups", choices=("groups", "multiturn", "trace", "all"))
    b.add_argument("--trace", help="a Mooncake JSONL trace for --workload trace")
    b.add_argument("--json", dest="json_path", help="also write the results to this file")
    b.add_argument("--plot", dest="plot_path", help="also draw the results into this PNG")
    b.add_argument("--quick", action="store_true", help="a small run, a minute or two")
    b.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    b.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of a model")
    b.add_argument("--rate", type=float, default=None, help="arrivals per second")
    b.add_argument("--num-blocks", type=int, default=128, help="KV blocks per worker")
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
    from cachesvc.bench.routing import RoutingBenchArgs, run_routing_bench
    from cachesvc.bench.workloads import TraceScale

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
