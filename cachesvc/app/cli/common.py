"""What the `cachesvc` commands share: the user-facing error, the engine and sampling flags and
the configs built from them, and the flags of a client of `--server` (token, TLS, salt)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachesvc.kv.eviction.base import POLICY_NAMES

if TYPE_CHECKING:
    from cachesvc.kv.config import TierConfig
    from router.grpc.client import ClientTls
    from workers.config import EngineConfig


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def numbers(text: str, flag: str, kind: type = int) -> tuple[Any, ...]:
    """Comma-separated numbers of `kind` from a flag's `text`; else a `CliError` naming it."""
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CliError(f"{flag} takes numbers separated by commas, got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser, redis_flag: str = "--redis-url") -> None:
    """The flags of the engine a command runs (or the workers `serve` starts)."""
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
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="requests running at once, at most (default 128); more wait for a place",
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
    p.add_argument(
        "--scheme-calibration",
        default="auto",
        choices=("auto", "refresh", "off"),
        help="how the auto prefill scheme learns this machine's costs: measured at start once "
        "per machine, backend and model shape, then cached (auto); measured again (refresh); "
        "or the built-in rule (off)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--eviction-policy",
        default="lru",
        choices=POLICY_NAMES,
        help="the order the KV pool and the DRAM and NVMe tiers give up cached blocks in "
        "(default lru; `cachesvc simulate eviction` compares them)",
    )
    add_dtype_arg(p)
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
    p.add_argument(
        "--tier-codec",
        action="append",
        default=[],
        metavar="[TIER=]CODEC",
        help="how a tier stores blocks: raw, lz4, shuffle_lz4, auto (the fastest lossless one) "
        "or, trading a small error in the KV for ~3.7x the tokens per byte of float32 KV, int8 "
        "or fp8_e4m3; TIER is dram, nvme or redis (none: every tier); repeatable or "
        "comma-separated, e.g. `--tier-codec dram=int8,redis=int8` (default: dram=raw, nvme "
        "and redis auto)",
    )
    p.add_argument(
        "--tier-key-file",
        default=None,
        help="sign NVMe and Redis blocks with the secret in this file (32+ bytes; make one with "
        "`head -c 32 /dev/urandom | base64 > FILE`) and read back only blocks it signed",
    )


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """`--dtype`: the weights' and KV's dtype (None: the config file's or float32)."""
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="weights and KV cache dtype (default float32, the exact one); bfloat16 halves the "
        "bytes a step reads, on CPUs with native bf16 (avx512_bf16, amx_bf16) or GPUs",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags (read back by `sampling_kwargs`), shared by generate and chat."""
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags ask for (CACHESVC_* variables fill the rest)."""
    from workers.config import EngineConfig

    if args.model is not None and not Path(args.model).exists():
        raise CliError(f"--model: no such file or folder: {args.model}")
    return EngineConfig.from_env(
        model=args.model,
        kv_cache_mb=args.kv_cache_mb,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_cache,
        prefill_scheme=args.prefill_scheme,
        scheme_calibration=args.scheme_calibration,
        num_threads=args.threads,
        dtype=args.dtype,
        eviction_policy=getattr(args, "eviction_policy", None),
        tiers=tier_config(args),
    )


def tier_config(args: argparse.Namespace) -> TierConfig:
    from cachesvc.kv.config import TierConfig

    nvme_mb = args.nvme_mb if args.nvme_mb is not None else (1024 if args.nvme_path else 0)
    return TierConfig(
        dram_mb=args.dram_mb or 0,
        nvme_path=args.nvme_path,
        nvme_mb=nvme_mb,
        redis_url=getattr(args, "kv_redis_url", None),
        tier_key_file=args.tier_key_file,
        eviction_policy=getattr(args, "eviction_policy", "lru"),
        **tier_codecs(getattr(args, "tier_codec", [])),
    )


def tier_codecs(values: list[str]) -> dict[str, Any]:
    """TierConfig codec fields from `--tier-codec` values ("int8", "dram=int8,redis=raw");
    only the tiers named (every tier for a bare codec), so the rest keep their defaults."""
    from cachesvc.kv.config import TIER_CODECS, TierConfig

    out: dict[str, Any] = {}
    for item in (part.strip() for value in values for part in value.split(",")):
        tier, _, codec = item.rpartition("=")
        tiers = [tier] if tier else list(TierConfig().codecs)
        if codec not in TIER_CODECS or not set(tiers) <= set(TierConfig().codecs):
            raise CliError(
                f"--tier-codec: {item!r} is not [TIER=]CODEC with TIER one of dram, nvme, redis "
                f"and CODEC one of {', '.join(TIER_CODECS)}"
            )
        out.update({f"{name}_codec": codec for name in tiers})
    return out


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def output_json(prompt: str, out: Any) -> dict[str, Any]:
    """The JSON object `--json` prints for one offline output (a RequestOutput)."""
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
        "cache_write_tokens": out.num_cache_write_tokens,
    }


def read_token(path: str | None) -> str | None:
    """The bearer token in `--auth-token-file`; None without the flag."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise CliError(f"--auth-token-file: no such file: {file}")
    token = file.read_text().strip()
    if not token:
        raise CliError(f"--auth-token-file: {file} is empty")
    return token


def add_client_flags(p: argparse.ArgumentParser, salt_help: str) -> None:
    """The flags every client command shares: `--server`, its token and TLS, `--cache-salt`."""
    p.add_argument("--cache-salt", default=None, help=salt_help)
    p.add_argument(
        "--server", metavar="HOST:PORT", help="send the work to a running `cachesvc serve`"
    )
    p.add_argument("--auth-token-file", help="bearer token for --server (a file holding it)")
    p.add_argument(
        "--tls-ca-file",
        help="speak TLS to --server, trusting the PEM CA that signed its certificate",
    )
    p.add_argument("--tls-cert-file", help="mutual TLS: this client's PEM certificate")
    p.add_argument("--tls-key-file", help="mutual TLS: the PEM private key of --tls-cert-file")


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS settings the flags ask for (reads the files); None: plaintext."""
    from router.grpc.client import ClientTls

    cert, key = args.tls_cert_file, args.tls_key_file
    if (cert is None) != (key is None):
        raise CliError("--tls-cert-file and --tls-key-file go together: give both, or neither")
    if args.tls_ca_file is None and cert is None:
        return None
    return ClientTls(
        root_ca=_read_pem("--tls-ca-file", args.tls_ca_file),
        cert_chain=_read_pem("--tls-cert-file", cert),
        private_key=_read_pem("--tls-key-file", key),
    )


def _read_pem(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
