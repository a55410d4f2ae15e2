"""`cachesvc` command line: generate, chat, score, demo, bench, serve.

Heavy imports (torch, the model) happen inside the commands, so `cachesvc --help` is instant.
Bad input exits with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachesvc.cli_bench import add_bench_parser, run_bench_command
from cachesvc.cli_chat import add_chat_parser, run_chat_command
from cachesvc.cli_score import add_score_parser, run_score_command
from cachesvc.cli_serving import (
    add_client_flags,
    add_demo_serve_parser,
    add_serve_flags,
    client_tls,
    router_options,
    run_demo_serve_command,
    serve_options,
)
from cachesvc.cli_types import CliError

__all__ = ["CliError", "main"]


def _add_engine_args(p: argparse.ArgumentParser, redis_flag: str = "--redis-url") -> None:
    p.add_argument("--model", help="GGUF file or Hugging Face folder (default: embedded SmolLM2)")
    p.add_argument("--kv-cache-mb", type=int, default=None, help="KV pool size in MiB")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (the prefill chunk size)",
    )
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="compute every prompt from scratch"
    )
    p.add_argument(
        "--prefill-scheme",
        default="auto",
        choices=("auto", "naive", "split", "ragged", "cascade", "multi_item", "custom_mask"),
        help="how requests sharing a prefix in one batch are computed (default: chosen per batch)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dram-mb", type=float, default=None, help="DRAM tier below the KV pool, MiB")
    p.add_argument("--nvme-path", default=None, help="NVMe tier: a folder for KV block files")
    p.add_argument("--nvme-mb", type=float, default=None, help="NVMe tier size budget, MiB")
    # Password: CACHESVC_REDIS_PASSWORD, never a flag (it would show in `ps`).
    p.add_argument(
        redis_flag,
        dest="kv_redis_url",
        default=None,
        help="Redis tier shared by workers (redis:// or rediss://)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags (read back by `_sampling_kwargs`), shared by generate and chat."""
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (share the prompt's KV)")
    p.add_argument("--beam-width", type=int, default=1, help="beam search when > 1")
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachesvc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per output line")
    add_client_flags(gen, "isolate this tenant's prefix cache")
    _add_engine_args(gen)

    demo = sub.add_parser("demo", help="chat with the embedded model on a few prompts")
    demo.add_argument("--max-tokens", type=int, default=48)
    _add_engine_args(demo)

    serve = sub.add_parser("serve", help="the gRPC router over Ray workers, until Ctrl-C")
    serve.add_argument("--workers", type=int, default=1, help="worker actors to start")
    serve.add_argument("--ray-address", default=None, help="Ray cluster (default: start one)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--policy", default="prefix_aware", help="routing policy")
    serve.add_argument("--auth-token-file", help="require this bearer token (a file holding it)")
    serve.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="YAML/JSON file of ServeConfig fields (as the Helm chart writes it); flags whose "
        "value differs from their default override it",
    )
    # serve's --redis-url is the router's index; the KV tier may be another Redis.
    _add_engine_args(serve, redis_flag="--redis-tier-url")
    add_serve_flags(serve)

    add_bench_parser(sub)

    add_score_parser(sub, _add_engine_args)
    add_chat_parser(sub, _add_engine_args, _add_sampling_args)
    add_demo_serve_parser(sub, _add_engine_args)
    return parser


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


def _engine_config(args: argparse.Namespace) -> Any:
    from cachesvc.config import EngineConfig

    if args.model is not None and not Path(args.model).exists():
        raise CliError(f"--model: no such file or folder: {args.model}")
    return EngineConfig.from_env(
        model=args.model,
        kv_cache_mb=args.kv_cache_mb,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_cache,
        prefill_scheme=args.prefill_scheme,
        num_threads=args.threads,
        tiers=_tier_config(args),
    )


def _tier_config(args: argparse.Namespace) -> Any:
    from cachesvc.config import TierConfig

    nvme_mb = args.nvme_mb if args.nvme_mb is not None else (1024 if args.nvme_path else 0)
    return TierConfig(
        dram_mb=args.dram_mb or 0,
        nvme_path=args.nvme_path,
        nvme_mb=nvme_mb,
        redis_url=getattr(args, "kv_redis_url", None),
    )


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags, shared by the offline engine and the gRPC client."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": tuple(args.stop),
        "n": args.n,
        "ignore_eos": args.ignore_eos,
        "beam_width": args.beam_width,
    }


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from workers.engine.engine import Engine
    from workers.engine.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    params = SamplingParams(**_sampling_kwargs(args), length_penalty=args.length_penalty)
    engine = Engine(_engine_config(args))
    if args.chat:
        prompts = [_chat(engine, p, args.system) for p in prompts]
    outputs = engine.generate(prompts, params, cache_salt=args.cache_salt)
    for i, out in enumerate(outputs):
        prompt = prompts[i // args.n]
        if args.json:
            print(json.dumps(_output_json(prompt, out)), flush=True)
        else:
            print(out.text, flush=True)
    return 0


def _chat(engine: Any, text: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return str(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _output_json(prompt: str, out: Any) -> dict[str, Any]:
    return {
        "request_id": out.request_id,
        "prompt": prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "ttft_ms": out.ttft_ms,
        "decode_tokens_per_s": out.decode_tokens_per_s,
        "cached_tokens": out.num_cached_tokens,
        "cached_tokens_by_tier": dict(out.cached_tokens_by_tier),
        "computed_tokens": out.num_computed_tokens,
    }


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise CliError(f"--auth-token-file: no such file: {file}")
    token = file.read_text().strip()
    if not token:
        raise CliError(f"--auth-token-file: {file} is empty")
    return token


def _generate_remote(args: argparse.Namespace) -> int:
    from router.client import RemoteError, RemoteSampling, RouterClient

    if args.length_penalty != 1.0:
        raise CliError("--length-penalty is not part of the wire contract; use it offline")
    sampling = RemoteSampling(**_sampling_kwargs(args))
    prompts = _read_prompts(args)
    token = _read_token(args.auth_token_file)
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


def _serve_config(args: argparse.Namespace) -> Any:
    from router.config import RouterConfig
    from router.main import ServeConfig

    return ServeConfig(
        engine=_engine_config(args),
        router=RouterConfig(
            host=args.host,
            port=args.port,
            policy=args.policy,
            auth_token=_read_token(args.auth_token_file),
            **router_options(args),
        ),
        num_workers=args.workers,
        ray_address=args.ray_address,
        device=args.device,
        **serve_options(args),
    )


def _serve_config_file(path: str, flags: Any) -> Any:
    """The ServeConfig in `path` with the flags that differ from their defaults on top; the
    engine then takes CACHESVC_* variables where the file leaves a field unset (from_env)."""
    import dataclasses

    from cachesvc.config import EngineConfig
    from cachesvc.config_file import changed_fields, load_config_file, with_overrides
    from router.main import ServeConfig

    defaults = _serve_config(_parser().parse_args(["serve"]))
    config = with_overrides(load_config_file(path, ServeConfig), changed_fields(flags, defaults))
    fields = {f.name: getattr(config.engine, f.name) for f in dataclasses.fields(config.engine)}
    return dataclasses.replace(config, engine=EngineConfig.from_env(**fields))


def _cmd_serve(args: argparse.Namespace) -> int:
    from router.logs import configure_logging
    from router.main import run_serve

    configure_logging(args.log_format)

    config = _serve_config(args)
    if args.config:
        config = _serve_config_file(args.config, config)
    return run_serve(config)


def _cmd_demo(args: argparse.Namespace) -> int:
    from cachesvc.demo import run_demo

    return run_demo(_engine_config(args), max_tokens=args.max_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cachesvc` console script."""
    args = _parser().parse_args(argv)
    commands = {
        "generate": _cmd_generate,
        "demo": _cmd_demo,
        "bench": run_bench_command,
        "serve": _cmd_serve,
        "demo-serve": lambda a: run_demo_serve_command(a, _engine_config(a)),
        "score": lambda a: run_score_command(
            a, engine_config=lambda: _engine_config(a), read_token=_read_token
        ),
        "chat": lambda a: run_chat_command(
            a,
            sampling=_sampling_kwargs(a),
            engine_config=lambda: _engine_config(a),
            read_token=_read_token,
            output_json=_output_json,
        ),
    }
    try:
        return commands[args.command](args)
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
