"""Frozen, validated configuration objects: the only place that reads environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
PREFILL_SCHEMES = ("auto", "naive", "split", "ragged", "cascade", "multi_item", "custom_mask")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says how to fix it."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker's engine needs to start.

    `model` is a GGUF file or a Hugging Face folder; None means the embedded SmolLM2.
    The KV pool holds `num_blocks` blocks of `block_size` tokens; when `num_blocks` is None it
    is sized from `kv_cache_mb`.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_mb: int = 512
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # How requests sharing a prefix in one batch are computed (the seed article's schemes);
    # "auto" picks per batch from its shape and measured costs.
    prefill_scheme: str = "auto"
    attention_backend: str = "torch"
    max_model_len: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.prefill_scheme not in PREFILL_SCHEMES:
            raise ConfigError(
                f"prefill_scheme must be one of {PREFILL_SCHEMES}, got {self.prefill_scheme!r}"
            )
        for name in ("block_size", "kv_cache_mb", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def in_batch_mode(self) -> str:
        """What a request does with prefix blocks another request computes in the same step."""
        return {"naive": "ignore", "split": "defer"}.get(self.prefill_scheme, "share")

    @classmethod
    def from_env(cls, **overrides: object) -> EngineConfig:
        """Defaults, then CACHESVC_* environment variables, then explicit overrides."""
        env: dict[str, object] = {}
        if "CACHESVC_MODEL" in os.environ:
            env["model"] = os.environ["CACHESVC_MODEL"]
        if "CACHESVC_DEVICE" in os.environ:
            env["device"] = os.environ["CACHESVC_DEVICE"]
        if "CACHESVC_KV_CACHE_MB" in os.environ:
            env["kv_cache_mb"] = _env_int("CACHESVC_KV_CACHE_MB")
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {os.environ[name]!r}") from None
