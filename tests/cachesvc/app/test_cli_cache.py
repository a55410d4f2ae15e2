"""`cachesvc cache`: its verbs parse, and a bad flag is one line naming it (exit 2), before any
call reaches a router."""

from __future__ import annotations

import pytest

from cachesvc.app.cli.main import build_parser, main


def test_the_verbs_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["cache", "prewarm", "--addr", "h:1", "--prompt", "p", "--retention-s", "300"]
    )
    assert (args.verb, args.prompt, args.retention_s, args.session) == ("prewarm", "p", 300, None)
    args = parser.parse_args(["cache", "close-session", "--addr", "h:1", "conv-1"])
    assert (args.verb, args.session_id) == ("close-session", "conv-1")
    args = parser.parse_args(["cache", "quota", "--addr", "h:1", "--tenant", "acme"])
    assert (args.share, args.max_retention, args.retention_share) == (1.0, "24h", 0.5)
    assert parser.parse_args(["cache", "usage", "--addr", "h:1"]).verb == "usage"


def test_a_bad_retention_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cache", "quota", "--addr", "127.0.0.1:1", "--tenant", "a", "--max-retention", "2d"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cachesvc: error: --max-retention must be seconds or a duration"), err
