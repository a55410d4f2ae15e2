"""`cachesvc score`: log-probs of label tokens after a prefix and each item, in one pass."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from cachesvc.cli_types import CliError


def add_score_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the `score` subcommand on the CLI's subparsers."""
    p = sub.add_parser("score", help="score items after a shared prefix (multi-item scoring)")
    p.add_argument("--prefix", required=True, help="the shared prefix text")
    p.add_argument("--item", action="append", default=[], help="an item text (repeatable)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="a label: a token id, or text that is exactly one token (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per item")
    add_engine_args(p)


def _label_ids(engine: Any, labels: list[str]) -> list[int]:
    out = []
    for label in labels:
        if label.lstrip("-").isdigit():
            out.append(int(label))
            continue
        ids = engine.tokenizer.encode(label, add_special_tokens=False)
        if len(ids) != 1:
            raise CliError(f"--label {label!r} is {len(ids)} tokens; give a single token or an id")
        out.append(ids[0])
    return out


def run_score_command(args: argparse.Namespace, config: Any) -> int:
    """Load the engine, score, print one line (or JSON object) per item."""
    from workers.engine.engine import Engine

    if not args.item:
        raise CliError("--item: give at least one item")
    if not args.label:
        raise CliError("--label: give at least one label token")
    engine = Engine(config)
    labels = _label_ids(engine, args.label)
    rows = engine.score(args.prefix, args.item, labels)
    for item, row in zip(args.item, rows, strict=True):
        if args.json:
            print(json.dumps({"item": item, "label_token_ids": labels, "logprobs": row}))
        else:
            print(
                f"{item!r}: "
                + ", ".join(f"{lab}={lp:.4f}" for lab, lp in zip(args.label, row, strict=True))
            )
    return 0
