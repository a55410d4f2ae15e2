"""The worker process's one frozen config (`EngineConfig`) and the worker's vocabulary: dtypes,
prefill schemes, roles. Read from the environment only here and in the CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from cachesvc.kv.config import ConfigError, TierConfig, check_policy

_DTYPES = ("float32", "bfloat16", "float16")
PREFILL_SCHEMES = ("auto", "naive", "split", "ragged", "cascade", "multi_item", "custom_mask")
# "auto": measure the schemes' costs at start unless this machine's cache has them; "refresh":
# measure again; "off": the built-in rule alone.
SCHEME_CALIBRATIONS = ("auto", "refresh", "off")
# What a worker is for under prefill/decode disaggregation (`EngineConfig.role`).
WORKER_ROLES = ("mixed", "prefill", "decode")


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
    # Requests running at once, vLLM's CPU server's default. At 128 streams of short prompts, 64
    # made the later half wait for a place: TTFT p50 10.4-10.6 s against 7.5-7.6 at 128, and
    # 3-10% fewer requests/s; 64 keeps a smaller batch, so a shorter gap between tokens
    # (docs/benchmarks/serve.md, many streams).
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # How requests sharing a prefix in one batch are computed (the seed article's schemes);
    # "auto" picks per batch from its shape and measured costs.
    prefill_scheme: str = "auto"
    # How "auto" knows the schemes' costs on this machine (SCHEME_CALIBRATIONS).
    scheme_calibration: str = "auto"
    attention_backend: str = "torch"
    max_model_len: int | None = None
    num_threads: int | None = None
    # On a CPU device, keep the memory a step frees in the process's heap for the next step
    # instead of mapping it anew (workers/kernels/heap.py). Process-wide once on.
    retain_freed_heap: bool = True
    tiers: TierConfig = field(default_factory=TierConfig)
    # Let the load planner pull a prefix's blocks from the worker the router names as holding
    # more of it, when its calibrated cost beats computing them (a peer is one more source, like
    # a tier); a pull not answered within `peer_pull_timeout_s` is computed instead.
    peer_pull: bool = False
    peer_pull_timeout_s: float = 5.0
    # The data plane between workers: a holder stages at most `peer_stage_mb` of KV per chunk
    # at a step boundary and serves at most `peer_max_exports` chunks at once (the rest wait
    # their turn, within the puller's deadline), so serving pulls never stalls its own decodes;
    # `peer_digest` is "fast" (a MAC over a 128-bit checksum of the payload) or "strict" (a
    # MAC over the payload itself, for an object store that is not trusted).
    peer_stage_mb: int = 64
    peer_max_exports: int = 2
    peer_digest: str = "fast"
    # A holder's shared-memory slots for pullers on its own node (no copy into the object
    # store): at most this much host memory, made on first use and kept; 0 turns them off.
    peer_shm_mb: int = 1024
    # A preference the router honours, not a restriction this worker enforces: a "prefill"
    # worker computes prompts whose KV a decode worker then pulls; a "decode" worker decodes
    # (and may still compute a short prompt itself, when pulling would cost more); a "mixed"
    # worker does both. Any worker runs whatever it is sent.
    role: str = "mixed"
    # The order the device pool reuses cached free blocks in (`cachesvc.kv.eviction`).
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        check_policy("eviction_policy", self.eviction_policy)
        if self.role not in WORKER_ROLES:
            raise ConfigError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.peer_pull_timeout_s <= 0:
            raise ConfigError(f"peer_pull_timeout_s must be > 0, got {self.peer_pull_timeout_s}")
        if self.peer_stage_mb < 1 or self.peer_max_exports < 1:
            raise ConfigError(
                f"peer_stage_mb and peer_max_exports must be >= 1, got {self.peer_stage_mb} "
                f"and {self.peer_max_exports}"
            )
        if self.peer_shm_mb < 0:
            raise ConfigError(f"peer_shm_mb must be >= 0 (0: no slots), got {self.peer_shm_mb}")
        if self.peer_digest not in ("fast", "strict"):
            raise ConfigError(f"peer_digest must be 'fast' or 'strict', got {self.peer_digest!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.prefill_scheme not in PREFILL_SCHEMES:
            raise ConfigError(
                f"prefill_scheme must be one of {PREFILL_SCHEMES}, got {self.prefill_scheme!r}"
            )
        if self.scheme_calibration not in SCHEME_CALIBRATIONS:
            raise ConfigError(
                f"scheme_calibration must be one of {SCHEME_CALIBRATIONS}, "
                f"got {self.scheme_calibration!r}"
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
        tiers = overrides.pop("tiers", None)
        if isinstance(tiers, TierConfig) or "CACHESVC_REDIS_PASSWORD" in os.environ:
            # The Redis password comes from the environment, never from a command line.
            base = tiers if isinstance(tiers, TierConfig) else TierConfig()
            password = os.environ.get("CACHESVC_REDIS_PASSWORD", base.redis_password)
            env["tiers"] = replace(base, redis_password=password)
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {os.environ[name]!r}") from None
