"""`cachesvc` command line: generate, chat, score, demo, bench, serve, cache.

Each command group is its own module; this one assembles the parser and runs the command.
Heavy imports (torch, the model) happen inside the commands, so `cachesvc --help` is instant.
Bad input exits with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from cachesvc.app.cli.bench import add_bench_parser, run_bench_command
from cachesvc.app.cli.cache import add_cache_parser, run_cache_command
from cachesvc.app.cli.chat import add_chat_parser, run_chat_command
from cachesvc.app.cli.common import CliError
from cachesvc.app.cli.demo import (
    add_demo_parser,
    add_demo_serve_parser,
    run_demo_command,
    run_demo_serve_command,
)
from cachesvc.app.cli.generate import add_generate_parser, run_generate_command
from cachesvc.app.cli.score import add_score_parser, run_score_command
from cachesvc.app.cli.serve import add_serve_parser, run_serve_command
from cachesvc.app.cli.simulate import add_simulate_parser, run_simulate_command

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": run_generate_command,
    "demo": run_demo_command,
    "bench": run_bench_command,
    "serve": run_serve_command,
    "demo-serve": run_demo_serve_command,
    "score": run_score_command,
    "chat": run_chat_command,
    "simulate": run_simulate_command,
    "cache": run_cache_command,
}


def build_parser() -> argparse.ArgumentParser:
    """The whole `cachesvc` parser (subcommands in the order `--help` lists them)."""
    parser = argparse.ArgumentParser(prog="cachesvc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_demo_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_score_parser(sub)
    add_chat_parser(sub)
    add_demo_serve_parser(sub)
    add_simulate_parser(sub)
    add_cache_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cachesvc` console script."""
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except CliError as exc:
        print(f"cachesvc: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        # Typed errors from the engine (PromptError, ModelLoadError, ConfigError, ...) and
        # unreadable files are the user's input: one line, no traceback.
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"cachesvc: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a chat or a long run: no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
