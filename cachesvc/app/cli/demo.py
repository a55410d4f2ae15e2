"""`cachesvc demo` (the engine in-process on a few prompts) and `cachesvc demo-serve` (the whole
service: router + workers, a demo workload through gRPC, stop)."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.app.cli.common import add_engine_args, engine_config


def add_demo_parser(sub: Any) -> None:
    """Register `demo` on the CLI's subparsers."""
    demo = sub.add_parser("demo", help="chat with the embedded model on a few prompts")
    demo.add_argument("--max-tokens", type=int, default=48)
    add_engine_args(demo)


def add_demo_serve_parser(sub: Any) -> None:
    """Register `demo-serve` on the CLI's subparsers."""
    demo_serve = sub.add_parser(
        "demo-serve",
        help="start the service (router + workers), send a demo workload through gRPC, stop",
    )
    demo_serve.add_argument(
        "--workers", type=int, default=2, help="worker actors (at most 2 on CPU)"
    )
    demo_serve.add_argument("--max-tokens", type=int, default=24)
    add_engine_args(demo_serve)


def run_demo_command(args: argparse.Namespace) -> int:
    """A few chat prompts through the engine in-process; returns the exit status."""
    from cachesvc.app.demo import run_demo

    return run_demo(engine_config(args), max_tokens=args.max_tokens)


def run_demo_serve_command(args: argparse.Namespace) -> int:
    """The whole service on this machine, a demo workload through gRPC; the exit status."""
    from cachesvc.app.demo_serve import run_demo_serve

    return run_demo_serve(engine_config(args), num_workers=args.workers, max_tokens=args.max_tokens)
