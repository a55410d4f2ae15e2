"""`cachesvc score`: log-probs of label tokens after a prefix and each item, in one pass,
offline or through `--server`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from cachesvc.app.cli.common import (
    CliError,
    add_client_flags,
    add_engine_args,
    client_tls,
    engine_config,
    read_token,
)


def add_score_parser(sub: Any) -> None:
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
    # Only routing looks at the salt: a scoring pass reuses no cached blocks, so offline it
    # changes nothing.
    add_client_flags(p, "this tenant's salt for --server routing")
    add_engine_args(p)


def _label_ids(labels: Sequence[str], encode: Callable[[str], list[int]]) -> list[int]:
    """The labels as token ids: an integer is taken as an id, text must `encode` (without the
    model's bos/eos) to exactly one token; raises CliError otherwise."""
    out = []
    for label in labels:
        if label.lstrip("-").isdigit():
            out.append(int(label))
            continue
        ids = encode(label)
        if len(ids) != 1:
            raise CliError(f"--label {label!r} is {len(ids)} tokens; give a single token or an id")
        out.append(ids[0])
    return out


def run_score_command(args: argparse.Namespace) -> int:
    """Score in-process or through `--server`; print one line (or JSON object) per item."""
    if not args.item:
        raise CliError("--item: give at least one item")
    if not args.label:
        raise CliError("--label: give at least one label token")
    if args.server:
        labels, rows = _score_remote(args, read_token(args.auth_token_file))
    else:
        labels, rows = _score_offline(args, engine_config(args))
    for item, row in zip(args.item, rows, strict=True):
        if args.json:
            print(json.dumps({"item": item, "label_token_ids": labels, "logprobs": row}))
        else:
            print(
                f"{item!r}: "
                + ", ".join(f"{lab}={lp:.4f}" for lab, lp in zip(args.label, row, strict=True))
            )
    return 0


def _score_offline(args: argparse.Namespace, config: Any) -> tuple[list[int], list[list[float]]]:
    from workers.engine.engine import Engine

    engine = Engine(config)
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise CliError(f"--label {text!r}: this model has no tokenizer; give a token id")
        return tokenizer.encode(text, add_special_tokens=False)

    labels = _label_ids(args.label, encode)
    return labels, engine.score(args.prefix, args.item, labels)


def _score_remote(
    args: argparse.Namespace, token: str | None
) -> tuple[list[int], list[list[float]]]:
    from router.grpc.client import RemoteError, RouterClient

    with RouterClient(args.server, token, client_tls(args)) as client:
        try:
            labels = _label_ids(args.label, client.encode_continuation)
            rows = client.score(args.prefix, args.item, labels, cache_salt=args.cache_salt)
        except RemoteError as exc:
            raise CliError(f"--server {args.server}: {exc}") from exc
    return labels, rows
