"""`cachesvc chat` offline: the history is resent each turn and the earlier turns come from the
prefix cache; `/reset` and `/exit`; the JSON objects are `generate --json`'s plus `turn`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from cachesvc.app.cli.chat import Message, converse, user_turns
from cachesvc.app.cli.main import main
from workers.model.tiny import WordTokenizer, write_tiny_model

BLOCK = 4
ENGINE_ARGS = ["--block-size", str(BLOCK), "--num-blocks", "256", "--threads", "1"]
GREEDY = ["--json", "--max-tokens", "6", "--ignore-eos"]
# Whole words, so a reply's text re-encodes to exactly the tokens generated: the next turn's
# prompt then extends this turn's prompt and reply token for token.
WORDS = ["system", "user", "assistant", "hello", "there", "tell", "me", "more", "Be", "terse"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "[UNK]"]
VOCAB = 64


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer (the default ChatML template)."""
    tokenizer = WordTokenizer(words=WORDS, special=SPECIAL, unk="[UNK]", eos="<|im_end|>")
    path = tmp_path_factory.mktemp("tiny-chat")
    # The default seed's short replies hold no special token: one would decode to nothing, and
    # the next turn's prompt would no longer extend this turn's tokens (some seeds do that).
    return write_tiny_model(path, vocab_size=VOCAB, hidden_size=32, tokenizer=tokenizer)


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


def _chat(capsys: pytest.CaptureFixture[str], model: Path, *args: str) -> list[dict[str, Any]]:
    argv = ["chat", *GREEDY, "--model", str(model), *ENGINE_ARGS, *args]
    return [json.loads(line) for line in _run(capsys, argv)]


def test_second_turn_reuses_the_first_from_cache(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = ["--system", "Be terse", "--message", "hello there", "--message", "tell me more"]
    first, second = _chat(capsys, chat_model, *script)
    assert (first["turn"], second["turn"]) == (0, 1)
    # The whole history is resent: turn 0's prompt and reply are the start of turn 1's prompt.
    turn0 = first["prompt_token_ids"] + first["token_ids"]
    assert second["prompt_token_ids"][: len(turn0)] == turn0
    assert second["prompt"].startswith(first["prompt"] + first["text"])
    # ... and come from the cache: past the first prompt, so the reply's blocks count too (the
    # last reply token was never fed back, so its block may be missing).
    assert second["cached_tokens"] > len(first["prompt_token_ids"])
    assert second["cached_tokens"] >= (len(turn0) - 1) // BLOCK * BLOCK
    assert second["cached_tokens"] + second["computed_tokens"] == len(second["prompt_token_ids"])
    # Reference: the same conversation computed from scratch says the same.
    uncached = _chat(capsys, chat_model, *script, "--no-prefix-cache")
    assert [u["cached_tokens"] for u in uncached] == [0, 0]
    assert [u["token_ids"] for u in uncached] == [first["token_ids"], second["token_ids"]]


def test_reset_starts_over_and_exit_stops(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = ["hello there", "tell me more", "/reset", "hello there", "/exit", "never sent"]
    outs = _chat(capsys, chat_model, "--system", "Be terse", *(f"--message={m}" for m in script))
    assert [o["turn"] for o in outs] == [0, 1, 0]
    again = outs[2]
    # After /reset only the system message is left: turn 0 again, its prompt cached but for
    # the block holding the last token (always computed, for its logits).
    assert again["prompt_token_ids"] == outs[0]["prompt_token_ids"]
    assert again["token_ids"] == outs[0]["token_ids"]
    assert again["cached_tokens"] == (len(again["prompt_token_ids"]) - 1) // BLOCK * BLOCK
    assert "tell" not in again["prompt"]


def test_json_is_generates_plus_worker_and_turn(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    [reply] = _chat(capsys, chat_model, "--system", "Be terse", "--message", "hello there")
    argv = ["generate", *GREEDY, "--chat", "--system", "Be terse", "--prompt", "hello there"]
    [generated] = map(json.loads, _run(capsys, [*argv, "--model", str(chat_model), *ENGINE_ARGS]))
    assert list(reply) == [*generated, "worker_id", "turn"]
    assert (reply["worker_id"], reply["turn"]) == (None, 0)
    for key in ("prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"):
        assert reply[key] == generated[key], key


def test_turns_from_stdin_and_plain_output(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    [expected] = _chat(capsys, chat_model, "--message", "hello there")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n\n/reset\nhello there\n"))
    out = _run(capsys, ["chat", "--max-tokens", "6", "--ignore-eos", "--model", str(chat_model)])
    assert out == [expected["text"]] * 2


class _Echo:
    """Replies with the number of messages it was sent, and keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[list[Message]] = []

    def reply(self, messages: list[Message], on_text: Any = None) -> dict[str, Any]:
        self.sent.append(list(messages))
        text = f"r{len(messages)}"
        if on_text is not None:
            for piece in text:
                on_text(piece)
        return {"text": text}


def test_converse_resends_the_whole_history() -> None:
    echo, emitted = _Echo(), list[dict[str, Any]]()
    converse(["a", "b", "/reset", "c", "/exit", "d"], echo, "sys", emitted.append)
    sys_, a = {"role": "system", "content": "sys"}, {"role": "user", "content": "a"}
    assert echo.sent == [
        [sys_, a],
        [sys_, a, {"role": "assistant", "content": "r2"}, {"role": "user", "content": "b"}],
        [sys_, {"role": "user", "content": "c"}],
    ]
    assert emitted == [
        {"text": "r2", "turn": 0},
        {"text": "r4", "turn": 1},
        {"text": "r2", "turn": 0},
    ]
    echo.sent.clear()
    converse(["a"], echo, None, lambda _: None)
    assert echo.sent == [[a]]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("messages", "stdin", "turns", "prompts"),
    [
        (["a", "/reset"], _Terminal("ignored\n"), ["a", "/reset"], ""),
        ([], io.StringIO(" a \n\n  \nb"), ["a", "b"], ""),
        ([], _Terminal("a\n\nb\n"), ["a", "b"], "> " * 4),  # a prompt per read, EOF's too
        ([], _Terminal(""), [], "> "),
    ],
)
def test_user_turns(messages: list[str], stdin: Any, turns: list[str], prompts: str) -> None:
    shown = io.StringIO()
    assert list(user_turns(messages, stdin, shown)) == turns
    assert shown.getvalue() == prompts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "2"], "--n and --beam-width"),
        (["--beam-width", "2"], "--n and --beam-width"),
        (["--length-penalty", "2"], "--length-penalty"),
        (["--message", " "], "--message: a message is empty"),
        (["--system", ""], "--system"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chat", "--message", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_replies_stream_piece_by_piece_and_add_up_to_the_reply(chat_model: Path) -> None:
    from cachesvc.app.cli.chat import _OfflineReplier
    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(chat_model), num_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    replier = _OfflineReplier(engine, params, None, lambda prompt, out: {"text": out.text})
    pieces: list[str] = []
    out = replier.reply([{"role": "user", "content": "hello there"}], pieces.append)
    assert len(pieces) > 1, "the text must come as it is generated, not at the end"
    assert "".join(pieces) == out["text"] != ""
    emitted: list[dict[str, Any]] = []
    converse(["hi", "/exit"], _Echo(), None, emitted.append, pieces.append)
    assert pieces[-2:] == ["r", "1"] and emitted == [{"text": "r1", "turn": 0}]
