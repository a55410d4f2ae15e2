"""`cachesvc chat --server` against a real router over Ray workers: the same greedy replies and
JSON keys as offline `chat`, and later turns served from the worker's prefix cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_support import cli_lines, server_args

from cachesvc.app.cli.main import main

pytestmark = pytest.mark.system
ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
TOKEN = "chat-secret"
SCRIPT = ["hello world", "The quick brown fox", "/reset", "hello router"]
CHAT = ["chat", "--max-tokens", "6", "--ignore-eos", "--system", "You are terse."]
CHAT += [f"--message={m}" for m in SCRIPT]
# Differ run to run, or between in-process and served.
VOLATILE = ("request_id", "ttft_ms", "decode_tokens_per_s", "worker_id")
# Where a prompt's tokens came from depends on the worker the router picked: a new conversation
# sharing only the system prompt may start on the other of two workers (the offline engine has
# the one cache). The second turn's cache is checked on its own below.
CACHE_SPLIT = ("cached_tokens", "computed_tokens", "cached_tokens_by_tier", "cache_write_tokens")


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(policy="prefix_aware", auth_token=TOKEN)


@pytest.fixture()
def remote_args(server: Any, tmp_path: Path) -> list[str]:
    return server_args(server, TOKEN, tmp_path)


def test_chat_over_the_server_matches_offline(
    remote_args: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline_argv = [*CHAT, "--json", "--model", str(tiny_model_dir), *ENGINE_ARGS]
    offline = [json.loads(line) for line in cli_lines(capsys, offline_argv)]
    remote = [json.loads(line) for line in cli_lines(capsys, [*CHAT, "--json", *remote_args])]
    assert [r["turn"] for r in remote] == [o["turn"] for o in offline] == [0, 1, 0]
    for here, there in zip(offline, remote, strict=True):
        assert list(here) == list(there)
        assert here["worker_id"] is None and there["worker_id"].startswith("worker-")
        skip = (*VOLATILE, *CACHE_SPLIT)
        assert {k: v for k, v in here.items() if k not in skip} == {
            k: v for k, v in there.items() if k not in skip
        }
        assert here["cached_tokens"] + here["computed_tokens"] == (
            there["cached_tokens"] + there["computed_tokens"]
        )
    # The second turn resent the first: the worker that served it had its prompt cached.
    first, second = remote[:2]
    assert second["worker_id"] == first["worker_id"]
    assert second["cached_tokens"] >= (len(first["prompt_token_ids"]) - 1) // 4 * 4 > 0


def test_plain_replies_and_errors_over_the_server(
    remote_args: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline = cli_lines(capsys, [*CHAT, "--model", str(tiny_model_dir), *ENGINE_ARGS])
    assert cli_lines(capsys, [*CHAT, *remote_args]) == offline
    assert main([*CHAT, *remote_args[:2]]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
