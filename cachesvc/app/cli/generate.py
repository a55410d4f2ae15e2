"""`cachesvc generate`: text for prompts, from the engine in-process or through `--server`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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


def add_generate_parser(sub: Any) -> None:
    """Register the `generate` subcommand on the CLI's subparsers."""
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per output line")
    add_client_flags(gen, "isolate this tenant's prefix cache")
    add_engine_args(gen)


def run_generate_command(args: argparse.Namespace) -> int:
    """Generate for every prompt; print each output's text (or its JSON object)."""
    if args.server:
        return _generate_remote(args)
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    params = SamplingParams(**sampling_kwargs(args), length_penalty=args.length_penalty)
    engine = Engine(engine_config(args))
    if args.chat:
        prompts = [_chat(engine, p, args.system) for p in prompts]
    outputs = engine.generate(prompts, params, cache_salt=args.cache_salt)
    for i, out in enumerate(outputs):
        prompt = prompts[i // args.n]
        if args.json:
            print(json.dumps(output_json(prompt, out)), flush=True)
        else:
            print(out.text, flush=True)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise CliError(f"--prompt-file: no such file: {path}")
        prompts.extend(line for line in path.read_text().splitlines() if line.strip())
    if not prompts:
        raise CliError("no prompt given: use --prompt TEXT or --prompt-file FILE")
    if any(not p.strip() for p in prompts):
        raise CliError("--prompt: a prompt is empty")
    return prompts


def _chat(engine: Any, text: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return str(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _generate_remote(args: argparse.Namespace) -> int:
    from router.grpc.client import RemoteError, RemoteSampling, RouterClient

    if args.length_penalty != 1.0:
        raise CliError("--length-penalty is not part of the wire contract; use it offline")
    sampling = RemoteSampling(**sampling_kwargs(args))
    prompts = _read_prompts(args)
    token = read_token(args.auth_token_file)
    with RouterClient(args.server, token, client_tls(args)) as client:
        for prompt in prompts:
            try:
                outs = client.generate(
                    prompt, sampling, chat=args.chat, system=args.system, cache_salt=args.cache_salt
                )
            except RemoteError as exc:
                raise CliError(f"--server {args.server}: {exc}") from exc
            for out in outs:
                print(json.dumps(out) if args.json else out["text"], flush=True)
    return 0
