"""Command-line pieces of the serving layer, registered by `cachesvc.cli`: the router's
scale-out, operations and security flags on `serve`, the TLS flags of its clients,
`demo-serve`, and `bench routing`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachesvc.cli_types import CliError

if TYPE_CHECKING:
    from router.client import ClientTls


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
        "--health-port",
        type=int,
        default=None,
        help="also serve the gRPC health service alone, in plaintext, on 127.0.0.1:PORT (for "
        "probes that cannot speak TLS)",
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
    serve.add_argument(
        "--tenant-tokens-file",
        help="a file of 'TENANT TOKEN' lines: each token is accepted and isolates its tenant's "
        "cache (with or without --auth-token-file, the operator's token)",
    )
    serve.add_argument("--tls-cert-file", help="serve TLS with this PEM certificate (chain)")
    serve.add_argument("--tls-key-file", help="the PEM private key of --tls-cert-file")
    serve.add_argument(
        "--tls-client-ca-file",
        help="mutual TLS: require client certificates signed by this PEM CA",
    )
    serve.add_argument(
        "--ray-namespace",
        default="cachesvc",
        help="Ray namespace of the workers (named cachesvc-worker-<i>); --attach looks there",
    )
    serve.add_argument(
        "--attach",
        action="store_true",
        help="route over the workers a running `cachesvc serve` started on --ray-address "
        "(same --ray-namespace and --model); they are left running on exit",
    )


def router_options(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `add_serve_flags` added (reads the tenant tokens
    file)."""
    from router.config import load_tenant_tokens

    tenants = args.tenant_tokens_file
    return {
        "redis_url": args.redis_url,
        "redis_namespace": args.redis_namespace,
        "metrics_port": args.metrics_port,
        "health_port": args.health_port,
        "max_queued_per_worker": args.max_queued_per_worker,
        "max_inflight": args.max_inflight,
        "tenant_tokens": () if tenants is None else load_tenant_tokens(tenants),
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
        "tls_client_ca_file": args.tls_client_ca_file,
    }


def serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServeConfig fields from the worker flags `add_serve_flags` added."""
    return {"ray_namespace": args.ray_namespace, "attach": args.attach}


def add_client_flags(p: argparse.ArgumentParser, salt_help: str) -> None:
    """The flags every client command shares: `--server`, its token and TLS, `--cache-salt`."""
    p.add_argument("--cache-salt", default=None, help=salt_help)
    p.add_argument(
        "--server", metavar="HOST:PORT", help="send the work to a running `cachesvc serve`"
    )
    p.add_argument("--auth-token-file", help="bearer token for --server (a file holding it)")
    p.add_argument(
        "--tls-ca-file",
        help="speak TLS to --server, trusting the PEM CA that signed its certificate",
    )
    p.add_argument("--tls-cert-file", help="mutual TLS: this client's PEM certificate")
    p.add_argument("--tls-key-file", help="mutual TLS: the PEM private key of --tls-cert-file")


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS settings the flags ask for (reads the files); None: plaintext."""
    from router.client import ClientTls

    cert, key = args.tls_cert_file, args.tls_key_file
    if (cert is None) != (key is None):
        raise CliError("--tls-cert-file and --tls-key-file go together: give both, or neither")
    if args.tls_ca_file is None and cert is None:
        return None
    return ClientTls(
        root_ca=_read_pem("--tls-ca-file", args.tls_ca_file),
        cert_chain=_read_pem("--tls-cert-file", cert),
        private_key=_read_pem("--tls-key-file", key),
    )


def _read_pem(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


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
