"""`cachesvc score --server` against a real router over Ray workers: the same log-probs, plain
lines and JSON objects as offline `score`, and one-line errors that name the flag at fault."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from cli_support import cli_lines, server_args

from cachesvc.app.cli.main import main
from workers.text.tokenizer import Tokenizer

pytestmark = pytest.mark.system
ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
TOKEN = "score-secret"
# "hello" is one token of the test tokenizer (trained on text full of it); 7 is a label by id.
SCORE = ["score", "--prefix", "The quick brown fox jumps over the lazy dog. hello"]
SCORE += ["--item", " world", "--item", " router, hello worker", "--item", " fox"]
SCORE += ["--label", "hello", "--label", "7"]


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(auth_token=TOKEN)


@pytest.fixture()
def remote_args(server: Any, tmp_path: Path) -> list[str]:
    return server_args(server, TOKEN, tmp_path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()  # one line, no traceback
    return line


def test_score_over_the_server_matches_offline(
    remote_args: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline_argv = [*SCORE, "--model", str(tiny_model_dir), *ENGINE_ARGS]
    offline = [json.loads(line) for line in cli_lines(capsys, [*offline_argv, "--json"])]
    remote = [json.loads(line) for line in cli_lines(capsys, [*SCORE, "--json", *remote_args])]
    [hello] = Tokenizer.from_path(tiny_model_dir).encode("hello", add_special_tokens=False)
    assert [o["item"] for o in offline] == [" world", " router, hello worker", " fox"]
    for here, there in zip(offline, remote, strict=True):
        assert list(here) == list(there) == ["item", "label_token_ids", "logprobs"]
        assert here["item"] == there["item"]
        assert here["label_token_ids"] == there["label_token_ids"] == [hello, 7]
        assert there["logprobs"] == pytest.approx(here["logprobs"], abs=1e-4)
        assert all(lp < 0 for lp in there["logprobs"])
    # Different items after the same prefix must not share one row (a routing mix-up would).
    assert offline[0]["logprobs"] != offline[2]["logprobs"]
    assert cli_lines(capsys, [*SCORE, *remote_args]) == cli_lines(capsys, offline_argv)


def test_salted_score_over_the_server_is_the_same(
    remote_args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    plain = cli_lines(capsys, [*SCORE, "--json", *remote_args])
    assert cli_lines(capsys, [*SCORE, "--json", "--cache-salt", "tenant-a", *remote_args]) == plain


def test_score_errors_name_the_flag(
    remote_args: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two_tokens = [*SCORE[:-4], "--label", "hello world"]
    offline = _error(capsys, [*two_tokens, "--model", str(tiny_model_dir), *ENGINE_ARGS])
    assert "--label 'hello world' is " in offline and "give a single token or an id" in offline
    assert _error(capsys, [*two_tokens, *remote_args]) == offline

    with socket.socket() as sock:  # a loopback port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{sock.getsockname()[1]}"
    assert f"--server {nobody}: UNAVAILABLE" in _error(capsys, [*SCORE, "--server", nobody])
    assert "UNAUTHENTICATED" in _error(capsys, [*SCORE, *remote_args[:2]])
    # An id is checked against the vocabulary on the server; the message names the field.
    bad_id = _error(capsys, [*SCORE[:-4], "--label", "99999", *remote_args])
    assert "INVALID_ARGUMENT: label_token_ids[0] = 99999" in bad_id
