"""`cachesvc serve`: the gRPC router over Ray workers, from flags or a config file; the flags
of its HTTP door, shared index, metrics, logs, limits, tenants, TLS and `--attach`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from cachesvc.app.cli.common import add_engine_args, engine_config, read_token

if TYPE_CHECKING:
    from cachesvc.app.serve import ServeConfig


def add_serve_parser(sub: Any) -> None:
    """Register the `serve` subcommand on the CLI's subparsers."""
    _add_serve_arguments(
        sub.add_parser("serve", help="the gRPC router over Ray workers, until Ctrl-C")
    )


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    from workers.cluster import PLACEMENTS

    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="mixed worker actors to start, each computing prompts and decoding (default: 1, "
        "or 0 when --prefill-workers or --decode-workers is given)",
    )
    serve.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        metavar="N",
        help="prefill/decode disaggregation: N workers that prefer computing prompts, whose KV "
        "decode workers pull; started besides --workers (total: N + M + --workers)",
    )
    serve.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        metavar="M",
        help="M workers that prefer decoding (a short prompt they may compute themselves); the "
        "router picks, per request, whether to disaggregate it",
    )
    serve.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="a prefill worker computes a prompt N tokens a step (default: the step budget, "
        "--max-batched-tokens): its decode worker pulls each chunk's KV while the next computes",
    )
    serve.add_argument(
        "--pd-mode",
        default="auto",
        choices=("auto", "always", "never"),
        help="with prefill workers: decide per request from calibrated costs and load (auto), "
        "hand every request to a prefill worker (always), or none (never)",
    )
    serve.add_argument(
        "--pd-mixed",
        action="store_true",
        help="with no prefill workers and two or more mixed ones: a prompt computed where the "
        "policy chose (or where it stalls fewer streams) may be decoded on another worker "
        "(--pd-mode auto: when predicted to pay; always: every request)",
    )
    for name, what in (("ttft", "time to first token"), ("itl", "gap between two tokens")):
        serve.add_argument(
            f"--pd-{name}-slo-ms",
            type=float,
            default=None,
            help=f"with --pd-mode auto: the {what} to keep within; the mode predicted to break "
            "fewer targets wins",
        )
    serve.add_argument(
        "--admit-ttft-ms",
        type=float,
        default=None,
        help="refuse (RESOURCE_EXHAUSTED, HTTP 429) a request predicted to wait longer than "
        "this for its first token, the prediction scaled by what admitted requests took "
        "(default: admit every request); e.g. 2000 for a 2 s TTFT target",
    )
    serve.add_argument(
        "--admit-itl-ms",
        type=float,
        default=None,
        help="refuse as well a request that would join or stall the streams of a worker that "
        "lately decodes them slower than this between tokens (default: never); e.g. 100",
    )
    serve.add_argument("--ray-address", default=None, help="Ray cluster (default: start one)")
    serve.add_argument(
        "--placement",
        default="spread",
        choices=PLACEMENTS,
        help="how workers are laid over the Ray cluster's nodes: spread (one node after "
        "another) or any (where Ray's default scheduler puts them)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--policy", default="prefix_aware", help="routing policy")
    serve.add_argument("--auth-token-file", help="require this bearer token (a file holding it)")
    serve.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="YAML/JSON file of ServeConfig fields (as the Helm chart writes it); flags whose "
        "value differs from their default override it",
    )
    # serve's --redis-url is the router's index; the KV tier may be another Redis.
    add_engine_args(serve, redis_flag="--redis-tier-url")
    _add_serve_flags(serve)


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
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
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health) on this port, with the same tokens and TLS as gRPC",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name on the HTTP API (default: the --model file or folder name)",
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
        "--response-cache-mb",
        type=float,
        default=64.0,
        help="answers of deterministic requests (greedy, beam, seeded) kept in memory, MiB; "
        "in Redis (with a TTL) when --response-cache-redis-url or --redis-url is given; 0 turns "
        "the cache off",
    )
    _add_response_cache_flags(serve)
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
        "--peer-pull",
        action="store_true",
        help="let workers pull a prefix another worker holds (a Ray call) when their planner "
        "finds it cheaper than computing it; the router then counts and names the holder",
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


def _add_response_cache_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of the response cache's Redis store and of the key that signs its entries."""
    serve.add_argument(
        "--response-cache-redis-url",
        default=None,
        help="keep the response cache in this Redis (redis://host:port/db), not the index's "
        "--redis-url: give it a server of its own with its own maxmemory (docs/deploy.md)",
    )
    serve.add_argument(
        "--response-cache-key-file",
        default=None,
        help="a file holding the secret (32+ bytes) that signs response-cache entries; the same "
        "for routers that share a Redis; default: --tier-key-file, else a key of this router alone",
    )
    serve.add_argument(
        "--response-cache-timeout-s",
        type=float,
        default=0.05,
        help="a response-cache lookup in Redis waits at most this long, then is a miss",
    )
    serve.add_argument(
        "--response-cache-max-entry-kb",
        type=float,
        default=256.0,
        help="answers whose entry exceeds this many KiB are not stored",
    )


def _response_cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `_add_response_cache_flags` added; entries are signed
    with the tier key unless a key of their own is given."""
    return {
        "response_cache_mb": args.response_cache_mb,
        "response_cache_redis_url": args.response_cache_redis_url,
        "response_cache_key_file": args.response_cache_key_file or args.tier_key_file,
        "response_cache_timeout_s": args.response_cache_timeout_s,
        "response_cache_max_entry_kb": args.response_cache_max_entry_kb,
    }


def _router_options(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `_add_serve_flags` added (reads the tenant tokens
    file)."""
    from router.tenants import load_tenant_tokens

    tenants = args.tenant_tokens_file
    return {
        "redis_url": args.redis_url,
        "redis_namespace": args.redis_namespace,
        "metrics_port": args.metrics_port,
        "health_port": args.health_port,
        "http_port": args.http_port,
        "served_model_name": args.served_model_name,
        "max_queued_per_worker": args.max_queued_per_worker,
        "max_inflight": args.max_inflight,
        "pd_mode": args.pd_mode,
        "pd_mixed": args.pd_mixed,
        "pd_ttft_slo_ms": args.pd_ttft_slo_ms,
        "pd_itl_slo_ms": args.pd_itl_slo_ms,
        "admit_ttft_ms": args.admit_ttft_ms,
        "admit_itl_ms": args.admit_itl_ms,
        **_response_cache_options(args),
        "tenant_tokens": () if tenants is None else load_tenant_tokens(tenants),
        "tls_cert_file": args.tls_cert_file,
        "tls_key_file": args.tls_key_file,
        "tls_client_ca_file": args.tls_client_ca_file,
    }


def _serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServeConfig fields from the worker flags `_add_serve_flags` added."""
    return {
        "ray_namespace": args.ray_namespace,
        "attach": args.attach,
        "placement": args.placement,
    }


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the flags ask for (reads the token and tenant files)."""
    from cachesvc.app.serve import ServeConfig
    from router.config import RouterConfig

    engine = engine_config(args)
    return ServeConfig(
        engine=dataclasses.replace(engine, peer_pull=True) if args.peer_pull else engine,
        router=RouterConfig(
            host=args.host,
            port=args.port,
            policy=args.policy,
            auth_token=read_token(args.auth_token_file),
            **_router_options(args),
        ),
        num_workers=args.workers,
        num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        ray_address=args.ray_address,
        device=args.device,
        **_serve_options(args),
    )


def serve_config_file(path: str, flags: ServeConfig) -> ServeConfig:
    """The ServeConfig in `path` with the flags that differ from their defaults on top; the
    engine then takes CACHESVC_* variables where the file leaves a field unset (from_env)."""
    from cachesvc.app.config_file import changed_fields, load_config_file, with_overrides
    from cachesvc.app.serve import ServeConfig
    from workers.config import EngineConfig

    defaults = serve_config(_defaults())
    config = with_overrides(load_config_file(path, ServeConfig), changed_fields(flags, defaults))
    if config.router.response_cache_key_file is None and config.engine.tiers.tier_key_file:
        # As with flags: the tier key signs response-cache entries unless they have their own.
        key_file = config.engine.tiers.tier_key_file
        router = dataclasses.replace(config.router, response_cache_key_file=key_file)
        config = dataclasses.replace(config, router=router)
    fields = {f.name: getattr(config.engine, f.name) for f in dataclasses.fields(config.engine)}
    return dataclasses.replace(config, engine=EngineConfig.from_env(**fields))


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve until a signal; returns the exit status."""
    from cachesvc.app.serve import run_serve
    from router.logs import configure_logging

    configure_logging(args.log_format)

    config = serve_config(args)
    if args.config:
        config = serve_config_file(args.config, config)
    _check_local_dtype(config)
    return run_serve(config)


def _check_local_dtype(config: ServeConfig) -> None:
    """Refuse, before Ray starts, a dtype the CPU of workers started on this machine lacks (a
    worker elsewhere checks its own CPU as it loads the model)."""
    import torch

    from workers.model.cpu_dtype import check_dtype_supported

    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if config.ray_address is None and not on_gpu:
        # The config's dtype names are torch's ("bfloat16" is torch.bfloat16).
        check_dtype_supported(getattr(torch, config.engine.dtype), "cpu")


def _defaults() -> argparse.Namespace:
    """The flags of `serve` at their defaults (what a config file's values are compared with)."""
    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    return parser.parse_args([])
