"""`cachesvc bench serve`: its flags and dispatch, beside `bench.py` (the bench itself,
`cachesvc.bench.serve`, is imported only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.app.cli.common import CliError, read_token


def add_bench_serve_parser(bench_sub: Any) -> None:
    """Register `bench serve` on the bench suites' subparsers."""
    from cachesvc.bench.serve_client import APIS
    from cachesvc.bench.serve_workload import QUESTION_WORDS, SYSTEM_WORDS, WORKLOADS

    b = bench_sub.add_parser(
        "serve",
        help="one workload against any OpenAI-compatible server (ours, vLLM): req/s, TTFT, ITL",
    )
    b.add_argument("--url", required=True, help="the server, http://HOST:PORT (/v1 optional)")
    b.add_argument(
        "--workload",
        default="shared-prefix",
        choices=WORKLOADS,
        help="shared-prefix: one system prompt shared by every request (~1,075 tokens); "
        "distinct: nothing shared (~1,050 tokens)",
    )
    b.add_argument("--concurrency", type=int, default=4, help="streams at once (closed loop)")
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--max-tokens", type=int, default=32, help="greedy tokens, ignore_eos")
    b.add_argument("--seed", type=int, default=0, help="of the prompts' words")
    b.add_argument("--model", default=None, help="the name to send (default: /v1/models' first)")
    b.add_argument(
        "--api", default="chat", choices=APIS, help="/v1/chat/completions or /v1/completions"
    )
    b.add_argument(
        "--system-words", type=int, default=SYSTEM_WORDS, help="system prompt words (~tokens)"
    )
    b.add_argument(
        "--question-words",
        type=int,
        default=None,
        help=f"question words (default {QUESTION_WORDS['shared-prefix']} shared-prefix, "
        f"{QUESTION_WORDS['distinct']} distinct)",
    )
    b.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured")
    b.add_argument("--auth-token-file", help="a bearer token for the server (a file holding it)")
    b.add_argument("--label", default=None, help="the server's name in the output")
    b.add_argument("--json", dest="json_path", help="also write the figures and answers here")
    b.add_argument(
        "--compare", default=None, help="an earlier run's --json: count prompts with the same text"
    )


def run_bench_serve_command(args: argparse.Namespace) -> int:
    """Run `cachesvc bench serve`; a bad flag value is a `CliError` naming it."""
    from cachesvc.bench.serve import ServeBenchArgs, run_serve_bench

    try:
        bench = ServeBenchArgs(
            url=args.url,
            workload=args.workload,
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            max_tokens=args.max_tokens,
            seed=args.seed,
            model=args.model,
            api=args.api,
            system_words=args.system_words,
            question_words=args.question_words,
            warmup=args.warmup,
            api_key=read_token(args.auth_token_file),
            json_path=args.json_path,
            compare=args.compare,
            label=args.label,
        )
        return run_serve_bench(bench)
    except ValueError as exc:
        raise CliError(str(exc)) from None
