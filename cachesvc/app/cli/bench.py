"""`cachesvc bench ...`: suites' flags and dispatch (ratios to a same-run baseline, lazy imports)"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from cachesvc.app.cli.bench_routing import add_routing_bench_parser, run_routing_bench_command
from cachesvc.app.cli.bench_serve import add_bench_serve_parser, run_bench_serve_command
from cachesvc.app.cli.common import CliError, add_dtype_arg

T = TypeVar("T")


def add_bench_parser(sub: Any) -> None:
    """Register `bench` and its suites on the CLI's subparsers."""
    from cachesvc.kv.config import TIER_CODECS

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
        if name == "prefill-schemes":
            b.add_argument(
                "--scheme-calibration",
                default="auto",
                choices=("auto", "refresh", "off"),
                help="the costs auto picks from: this machine's cached calibration, measured "
                "if absent (auto), measured again (refresh), or the built-in rule (off)",
            )
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
    tiers.add_argument(
        "--codec",
        default=None,
        choices=TIER_CODECS,
        help="every tier's codec (default: each tier's default)",
    )
    codec = bench_sub.add_parser(
        "kv-codec", help="tier codecs on real KV: bytes, speed, logit error, greedy agreement"
    )
    codec.add_argument("--json", dest="json_path", help="also write the results to this file")
    codec.add_argument("--quick", action="store_true", help="5 prompts, 16 tokens (else 20, 64)")
    codec.add_argument("--model", default=None)
    codec.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    kv = bench_sub.add_parser(
        "kv-transfer", help="KV between two workers: each path's GB/s, the holder's decode"
    )
    kv.add_argument("--json", dest="json_path", help="also write the results to this file")
    kv.add_argument("--quick", action="store_true", help="1K/4K tokens, a 512-token holder")
    kv.add_argument("--model", default=None, help="the holder part's model (default: SmolLM2)")
    kv.add_argument("--paths-only", action="store_true", help="skip the holder part")
    pd = bench_sub.add_parser(
        "pd", help="decodes while long prompts arrive: 2 mixed vs 1 prefill + 1 decode worker"
    )
    _add_live_bench_flags(pd, "2 streams, 2 prompts of 1K tokens")
    pd.add_argument(
        "--pd-mode", default="auto", choices=("auto", "always"), help="the router's pd_mode"
    )
    pd.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="the router's pd_itl_slo_ms: a stream's gap between two tokens to keep within",
    )
    pd.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=512,
        help="the prefill worker's chunk (serve's --prefill-chunk-tokens; 0: the step budget)",
    )
    pd.add_argument(
        "--no-prefetch",
        action="store_true",
        help="the decode worker pulls only after the first token (the router's pd_prefetch off)",
    )
    cc = bench_sub.add_parser(
        "cache-control", help="retention through a flood, tenant quotas, usage that adds up"
    )
    _add_live_bench_flags(cc, "a 1K prefix, a 2K-token pool")
    step = bench_sub.add_parser(
        "step", help="one decode step by phase, in-place attention vs gather, beside its floor"
    )
    _add_live_bench_flags(step, "batch 1 and 4 over 128 and 1K tokens")
    step.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_dtype_arg(step)
    step.add_argument("--steps", type=int, default=None, help="timed steps a round (8; quick 4)")
    step.add_argument("--rounds", type=int, default=None, help="rounds of each path (5; quick 3)")
    step.add_argument("--batches", default=None, help="comma-separated (default 1,4,16,64)")
    step.add_argument("--contexts", default=None, help="prompt tokens (default 128,1024,4096)")
    step.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every prompt of a cell starts with, counted once in the floor (default 0)",
    )
    step.add_argument(
        "--ray-stream",
        action="store_true",
        help="instead: one step's deltas through a local Ray actor, per request and in one list",
    )
    _add_dtype_agreement_parser(bench_sub)
    _add_admission_parser(bench_sub)
    add_routing_bench_parser(bench_sub)
    _add_agreement_parser(bench_sub)
    add_bench_serve_parser(bench_sub)
    rb = bench_sub.add_parser("router", help="the router's own cost per decision, per stage")
    rb.add_argument("--json", dest="json_path", help="also write the results to this file")
    rb.add_argument("--quick", action="store_true", help="fewer prompts, a few seconds")
    rb.add_argument(
        "--doors",
        action="store_true",
        help="instead: a live router's CPU per request on each door (gRPC, HTTP), minutes",
    )
    rb.add_argument("--model", default=None, help="with --doors: the model (default: SmolLM2)")
    rc = bench_sub.add_parser(
        "response-cache", help="repeated deterministic requests: response-cache hits vs generation"
    )
    rc.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    rc.add_argument("--repeats", type=int, default=4, help="times each prompt is sent")
    rc.add_argument("--max-tokens", type=int, default=16)
    rc.add_argument("--workers", type=int, default=1)
    rc.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    rc.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of a model")
    rc.add_argument("--json", dest="json_path", help="also write the results to this file")
    rc.add_argument("--quick", action="store_true", help="4 prompts, each sent twice")


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the suite `args.suite`; returns the exit status."""
    if args.suite == "routing":
        return run_routing_bench_command(args)
    if args.suite == "serve":
        return run_bench_serve_command(args)
    if args.suite == "sim-agreement":
        from cachesvc.bench.agreement import AgreementArgs, run_agreement

        benches = tuple(args.only or ("routing", "pd"))
        return run_agreement(_bench_args(AgreementArgs, args, benches=benches))
    if args.suite == "router" and args.doors:
        from cachesvc.bench.door_overhead import run_door_overhead_bench

        return run_door_overhead_bench(args.model, args.quick, args.json_path)
    if args.suite == "router":
        from cachesvc.bench.router_overhead import run_router_overhead_bench

        return run_router_overhead_bench(args.quick, args.json_path)
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

        return run_prefill_schemes_bench(
            args.quick,
            args.json_path,
            backend=args.backend,
            calibration=args.scheme_calibration,
        )
    if args.suite == "decode-cascade":
        from cachesvc.bench.decode_cascade import run_decode_cascade_bench

        return run_decode_cascade_bench(args.quick, args.json_path, backend=args.backend)
    if args.suite == "tiers":
        from cachesvc.bench.tiers.run import run_tiers_bench

        return run_tiers_bench(
            args.model, args.quick, args.json_path, args.redis_url, args.threads, args.codec
        )
    if args.suite == "kv-codec":
        from cachesvc.bench.kv_codec import run_kv_codec_bench

        return run_kv_codec_bench(args.model, args.quick, args.json_path, args.threads)
    if args.suite == "pd":
        from cachesvc.bench.pd import run_pd_bench
        from cachesvc.workloads.pd import PDBenchArgs

        chunk, prefetch = args.prefill_chunk_tokens or None, not args.no_prefetch
        return run_pd_bench(
            _bench_args(PDBenchArgs, args, prefill_chunk_tokens=chunk, prefetch=prefetch)
        )
    if args.suite == "cache-control":
        from cachesvc.bench.cache_control import CacheControlBenchArgs, run_cache_control_bench

        return run_cache_control_bench(_bench_args(CacheControlBenchArgs, args))
    if args.suite == "step":
        from cachesvc.bench.step.run import StepBenchArgs, run_step_bench

        grid = None
        if args.batches or args.contexts:
            from cachesvc.app.cli.common import numbers
            from cachesvc.bench.step.run import GRID, QUICK_GRID

            default = QUICK_GRID if args.quick else GRID
            batches = numbers(args.batches, "--batches") if args.batches else default[0]
            contexts = numbers(args.contexts, "--contexts") if args.contexts else default[1]
            grid = (batches, contexts)
        return run_step_bench(_bench_args(StepBenchArgs, args, grid=grid))
    if args.suite == "dtype-agreement":
        from cachesvc.bench.dtype_agreement import DtypeAgreementArgs, run_dtype_agreement_bench

        return run_dtype_agreement_bench(_bench_args(DtypeAgreementArgs, args))
    if args.suite == "admission":
        from cachesvc.bench.admission import run_admission_bench
        from cachesvc.workloads.admission import AdmissionBenchArgs

        return run_admission_bench(_bench_args(AdmissionBenchArgs, args))
    if args.suite == "kv-transfer":
        from cachesvc.bench.kv_transfer.run import run_kv_transfer_bench

        return run_kv_transfer_bench(args.quick, args.json_path, not args.paths_only, args.model)
    if args.suite == "response-cache":
        from cachesvc.bench.response_cache import ResponseCacheBenchArgs, run_response_cache_bench

        return run_response_cache_bench(
            ResponseCacheBenchArgs(
                prompts=4 if args.quick else args.prompts,
                repeats=2 if args.quick else args.repeats,
                max_tokens=args.max_tokens,
                workers=args.workers,
                model=args.model,
                tiny=args.tiny,
                json_path=args.json_path,
            )
        )
    if args.suite == "prefix-cache":
        from cachesvc.bench.prefix_cache import run_prefix_cache_bench

        return run_prefix_cache_bench(args)
    raise CliError(f"unknown benchmark {args.suite!r}")


def _bench_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """A bench's arguments (a dataclass) from the parsed flags of its fields' names, `given`
    supplying or replacing some; a value it rejects is a `CliError` with its message."""
    values = {
        f.name: given[f.name] if f.name in given else getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init
    }
    try:
        return cls(**values)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _add_live_bench_flags(bench: Any, quick_help: str) -> None:
    """The flags of a bench on live workers: --json, --quick (what it shrinks to), and the
    model (--model, or --tiny)."""
    bench.add_argument("--json", dest="json_path", help="also write the results to this file")
    bench.add_argument("--quick", action="store_true", help=quick_help)
    bench.add_argument("--model", default=None, help="default: SmolLM2")
    bench.add_argument("--tiny", action="store_true", help="a tiny random model instead")


def _add_dtype_agreement_parser(bench_sub: Any) -> None:
    b = bench_sub.add_parser(
        "dtype-agreement", help="greedy tokens of our bfloat16 engine against transformers'"
    )
    b.add_argument("--json", dest="json_path", help="also write the results to this file")
    b.add_argument("--quick", action="store_true", help="24 tokens, 4 random prompts")
    b.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    b.add_argument("--tokens", type=int, default=None, help="greedy tokens a prompt (64)")
    b.add_argument("--generated", type=int, default=None, help="random-token prompts (16)")


def _add_admission_parser(bench_sub: Any) -> None:
    b = bench_sub.add_parser(
        "admission", help="a burst past capacity on 2 workers: without and with admission"
    )
    _add_live_bench_flags(b, "10 s of prompts of 192 tokens")
    b.add_argument(
        "--ttft-ms", type=float, default=3000.0, help="the TTFT target and admit_ttft_ms"
    )
    b.add_argument(
        "--overload", type=float, default=2.0, help="the burst's rate over the measured capacity"
    )
    b.add_argument("--seconds", type=float, default=None, help="of arrivals (default 20, quick 10)")
    b.add_argument("--prompt-len", type=int, default=None, help="tokens a prompt (default 384)")
    b.add_argument(
        "--itl-ms",
        type=float,
        default=None,
        help="an inter-token target too: longer answers, goodput within both targets, and a "
        "third setup with admit_itl_ms",
    )
    b.add_argument(
        "--max-tokens", type=int, default=None, help="an answer's tokens (default 4; --itl-ms 32)"
    )


def _add_agreement_parser(bench_sub: Any) -> None:
    b = bench_sub.add_parser(
        "sim-agreement",
        help="the simulator against live bench routing and bench pd runs, figure by figure",
    )
    b.add_argument("--trace", help="the Mooncake JSONL trace bench routing samples")
    b.add_argument("--quick", action="store_true", help="both benches' --quick sizes")
    b.add_argument("--runs", type=int, default=3, help="live runs of each bench (medians)")
    b.add_argument("--profile", default="cpu-calibrated", help="the simulator's cost profile")
    b.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the profile first (cachesvc simulate calibrate), in the same sitting",
    )
    b.add_argument("--profile-out", default=None, help="with --calibrate: keep the profile here")
    b.add_argument(
        "--only", action="append", choices=("routing", "pd"), help="one bench (repeatable)"
    )
    b.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    b.add_argument("--json", dest="json_path", help="also write every run and figure here")
    b.add_argument(
        "--itl-slo-ms", type=float, default=None, help="bench pd's --itl-slo-ms, both sides"
    )
    b.add_argument(
        "--live-from",
        default=None,
        help="compare the live runs an earlier --json recorded instead of running new ones",
    )
