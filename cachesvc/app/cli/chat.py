"""`cachesvc chat`: a multi-turn conversation with the model, offline or through `--server`.

Every turn sends the whole history (system, user and assistant messages) through the chat
template, so the prefix cache serves the earlier turns and only the newest user message (and
the reply) is computed. User turns come from `--message` (scripted) or stdin, one line each
(a `> ` prompt when stdin is a terminal); `/reset` starts a new conversation, `/exit` ends.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from cachesvc.app.cli.common import (
    CliError,
    add_client_flags,
    add_engine_args,
    add_sampling_args,
    client_tls,
    engine_config,
    output_json,
    read_token,
    sampling_kwargs,
)

Message = dict[str, str]  # {"role": ..., "content": ...}, as the chat template takes them
RESET = "/reset"
EXIT = "/exit"


def add_chat_parser(sub: Any) -> None:
    """Register the `chat` subcommand on the CLI's subparsers."""
    p = sub.add_parser("chat", help="a multi-turn conversation (earlier turns come from cache)")
    p.add_argument(
        "--message",
        action="append",
        default=[],
        help=f"a user turn (repeatable; {RESET} and {EXIT} work too); default: stdin lines",
    )
    p.add_argument("--system", default=None, help="system message at the start of the history")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per assistant turn")
    add_client_flags(p, "isolate this tenant's prefix cache")
    add_engine_args(p)


TextSink = Callable[[str], None]


class Replier(Protocol):
    """Produces the assistant's reply to a conversation."""

    def reply(self, messages: list[Message], on_text: TextSink | None = None) -> dict[str, Any]:
        """The reply to `messages` (oldest first, ending with a user turn) as the JSON object
        `generate --json` prints for one sample, `worker_id` included; blocks until done.
        `on_text` gets the reply's text piece by piece as it is generated."""
        ...


@dataclass(frozen=True)
class _OfflineReplier:
    engine: Any
    params: Any
    cache_salt: str | None
    output_json: Callable[[str, Any], dict[str, Any]]

    def reply(self, messages: list[Message], on_text: TextSink | None = None) -> dict[str, Any]:
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        [request_id] = self.engine.add_request(prompt, self.params, cache_salt=self.cache_salt)
        final = None
        while final is None:
            for out in self.engine.step():
                if out.request_id != request_id:
                    continue
                if on_text is not None and out.delta_text:
                    on_text(out.delta_text)
                if out.finished:
                    final = out
        # No worker in-process; the key is there so both modes print the same keys.
        return {**self.output_json(prompt, final), "worker_id": None}


@dataclass(frozen=True)
class _RemoteReplier:
    client: Any
    sampling: Any
    cache_salt: str | None
    address: str

    def reply(self, messages: list[Message], on_text: TextSink | None = None) -> dict[str, Any]:
        from router.grpc.client import RemoteError

        out: dict[str, Any]
        try:
            [out] = self.client.chat(
                messages, self.sampling, cache_salt=self.cache_salt, on_text=on_text
            )
        except RemoteError as exc:
            raise CliError(f"--server {self.address}: {exc}") from exc
        return out


def user_turns(messages: list[str], stdin: TextIO, prompt_to: TextIO) -> Iterator[str]:
    """The user's turns: `messages` when given, else stdin lines (stripped, blank ones
    skipped), with a `> ` prompt on `prompt_to` when stdin is a terminal."""
    if messages:
        yield from messages
        return
    interactive = stdin.isatty()
    while True:
        if interactive:
            prompt_to.write("> ")
            prompt_to.flush()
        line = stdin.readline()
        if not line:
            return  # EOF
        if line.strip():
            yield line.strip()


def converse(
    turns: Iterable[str],
    replier: Replier,
    system: str | None,
    emit: Callable[[dict[str, Any]], None],
    on_text: TextSink | None = None,
) -> None:
    """Run the conversation: one reply per user turn, handed to `emit` with its `turn` (index
    within the current conversation) when complete, and to `on_text` piece by piece while it
    is generated. `/reset` drops the history (the system message stays); `/exit` stops."""
    opening: list[Message] = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    turn = 0
    for text in turns:
        if text == EXIT:
            break
        if text == RESET:
            history, turn = list(opening), 0
            continue
        history.append({"role": "user", "content": text})
        out = replier.reply(history, on_text)
        # The reply's text (not its token ids) goes into the history: the next turn's template
        # renders it like any assistant message, as a served chat client would send it.
        history.append({"role": "assistant", "content": out["text"]})
        emit({**out, "turn": turn})
        turn += 1


def _check_args(args: argparse.Namespace) -> None:
    if args.n != 1 or args.beam_width != 1:
        raise CliError("--n and --beam-width: chat continues one reply per turn; leave them at 1")
    if args.length_penalty != 1.0:
        raise CliError("--length-penalty applies to beam search, which chat does not use")
    if any(not m.strip() for m in args.message):
        raise CliError("--message: a message is empty")
    if args.system is not None and not args.system.strip():
        raise CliError("--system: the system message is empty")


def _output(as_json: bool) -> tuple[Callable[[dict[str, Any]], None], TextSink | None]:
    """How replies are printed: a JSON object per complete reply, or the text streamed as it
    comes and a newline at the end of each reply."""
    if as_json:
        return lambda out: print(json.dumps(out), flush=True), None

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    return lambda out: print(flush=True), stream


def run_chat_command(args: argparse.Namespace) -> int:
    """Hold the conversation offline (the engine in-process) or through `--server`; print each
    reply (or its JSON object)."""
    _check_args(args)
    sampling = sampling_kwargs(args)
    turns = user_turns(args.message, sys.stdin, sys.stderr)
    if args.server:
        from router.grpc.client import RemoteSampling, RouterClient

        remote_sampling = RemoteSampling(**sampling)
        token = read_token(args.auth_token_file)
        with RouterClient(args.server, token, client_tls(args)) as client:
            remote = _RemoteReplier(client, remote_sampling, args.cache_salt, args.server)
            converse(turns, remote, args.system, *_output(args.json))
        return 0
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    engine = Engine(engine_config(args))
    if engine.tokenizer is None:
        raise CliError("--model: this model has no tokenizer, so it has no chat template")
    offline = _OfflineReplier(engine, SamplingParams(**sampling), args.cache_salt, output_json)
    converse(turns, offline, args.system, *_output(args.json))
    return 0
