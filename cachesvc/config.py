"""Frozen, validated configuration objects: the only place that reads environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

_DTYPES = ("float32", "bfloat16", "float16")
PREFILL_SCHEMES = ("auto", "naive", "split", "ragged", "cascade", "multi_item", "custom_mask")
# "auto": measure the schemes' costs at start unless this machine's cache has them; "refresh":
# measure again; "off": the built-in rule alone.
SCHEME_CALIBRATIONS = ("auto", "refresh", "off")
# What a worker is for under prefill/decode disaggregation (`EngineConfig.role`).
WORKER_ROLES = ("mixed", "prefill", "decode")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says how to fix it."""


# "auto": at start, the engine probes the tier with each of `AUTO_CODECS` and keeps the one whose
# read + decode is fastest (compressing pays only on a link slower than the decode). The
# quantized codecs change the KV, hence what the model says: a tier uses one only when its
# operator names it, never through "auto".
QUANTIZED_CODECS = ("int8", "fp8_e4m3")
TIER_CODECS = ("auto", "raw", "lz4", "shuffle_lz4", *QUANTIZED_CODECS)
AUTO_CODECS = ("raw", "shuffle_lz4")  # the first of them until a probe decides
PLAN_MODES = ("auto", "fetch", "split", "recompute")
MIN_TIER_KEY_BYTES = 32  # the tier key: 256 bits, the strength of HMAC-SHA256


@dataclass(frozen=True)
class TierConfig:
    """The tiers below the device pool; all off by default (`enabled` is False).

    DRAM takes blocks the device evicts (`dram_mb`), NVMe takes what DRAM evicts (`nvme_path`,
    `nvme_mb`), Redis shares blocks reused at least `redis_min_reuse` times between workers
    (`redis_url`, rediss:// for TLS). `*_cap_mbps` throttle a tier's reads, for tests and
    benchmarks. `plan` forces the planner's choice ("auto" lets the cost model decide).

    A Redis call on the engine's thread waits at most `redis_read_timeout_s`: writes go through
    a background queue of at most `redis_queue_mb` (a write that finds it full is dropped and
    counted), each with `redis_timeout_s`; lookups and reads use the short timeout, and after
    `redis_breaker_failures` failed calls in a row Redis is skipped for `redis_retry_s`, then
    one call probes it.

    `*_codec` is how a tier stores blocks: `raw`, lossless `lz4` or `shuffle_lz4`, `auto` (the
    fastest lossless one, probed at start), or quantized `int8` / `fp8_e4m3` (a byte per
    value: ~3.7x the tokens of float32 KV per byte, at a small error in the fetched KV and
    so in the logits; `docs/benchmarks/tiers.md` measures it). None is lossy unless named.

    `tier_key_file` names a file holding the deployment secret (at least 32 bytes): blocks
    written to NVMe and Redis are then signed (HMAC-SHA256) and only blocks signed with it are
    read back. It is read where the engine starts (`read_key`), not where this is built.
    """

    dram_mb: float = 0
    nvme_path: str | None = None
    nvme_mb: float = 0
    redis_url: str | None = None
    redis_password: str | None = None
    redis_tls_ca_file: str | None = None
    redis_min_reuse: int = 2
    redis_ttl_s: int | None = 24 * 3600
    redis_timeout_s: float = 0.5
    redis_read_timeout_s: float = 0.1
    redis_retry_s: float = 2.0
    redis_breaker_failures: int = 3
    redis_queue_mb: float = 64
    dram_codec: str = "raw"
    nvme_codec: str = "auto"
    redis_codec: str = "auto"
    dram_cap_mbps: float | None = None
    nvme_cap_mbps: float | None = None
    redis_cap_mbps: float | None = None
    plan: str = "auto"
    calibrate: bool = True
    tier_key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("dram_mb", "nvme_mb", "redis_min_reuse"):
            if getattr(self, name) < 0:
                raise ConfigError(f"tiers.{name} must be >= 0, got {getattr(self, name)}")
        if self.nvme_path is not None and self.nvme_mb <= 0:
            raise ConfigError("tiers.nvme_mb must be positive when nvme_path is set (--nvme-mb)")
        if self.nvme_mb > 0 and not self.nvme_path:
            raise ConfigError("tiers.nvme_mb needs tiers.nvme_path, the folder (--nvme-path)")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(
                f"tiers.redis_url must start with redis://, rediss:// or unix://, "
                f"got {self.redis_url!r}"
            )
        for name in ("dram_codec", "nvme_codec", "redis_codec"):
            if getattr(self, name) not in TIER_CODECS:
                raise ConfigError(
                    f"tiers.{name} must be one of {TIER_CODECS}, got {getattr(self, name)!r} "
                    "(--tier-codec)"
                )
        for name in ("dram_cap_mbps", "nvme_cap_mbps", "redis_cap_mbps", "redis_ttl_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"tiers.{name} must be positive or None (no cap), got {value}")
        if self.redis_timeout_s <= 0 or self.redis_retry_s < 0:
            raise ConfigError("tiers.redis_timeout_s must be > 0 and tiers.redis_retry_s >= 0")
        for name in ("redis_read_timeout_s", "redis_queue_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"tiers.{name} must be positive, got {getattr(self, name)}")
        if self.redis_breaker_failures < 1:
            raise ConfigError(
                f"tiers.redis_breaker_failures must be >= 1, got {self.redis_breaker_failures}"
            )
        if self.tier_key_file is not None and not self.tier_key_file.strip():
            raise ConfigError("tiers.tier_key_file must name a file (--tier-key-file) or be None")
        if self.plan not in PLAN_MODES:
            raise ConfigError(f"tiers.plan must be one of {PLAN_MODES}, got {self.plan!r}")

    @property
    def enabled(self) -> bool:
        return self.dram_mb > 0 or self.nvme_path is not None or self.redis_url is not None

    @property
    def codecs(self) -> dict[str, str]:
        """The configured codec mode of each tier, by tier name."""
        return {"dram": self.dram_codec, "nvme": self.nvme_codec, "redis": self.redis_codec}

    def read_key(self) -> bytes | None:
        """The tier key: the bytes of `tier_key_file` without surrounding whitespace (None
        without the file). Raises ConfigError, saying how to make one, when it is unreadable or
        shorter than 32 bytes."""
        if self.tier_key_file is None:
            return None
        make = f"make one with: head -c 32 /dev/urandom | base64 > {self.tier_key_file}"
        try:
            key = Path(self.tier_key_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"tiers.tier_key_file: cannot read {self.tier_key_file}: "
                f"{exc.strerror or exc}; {make}"
            ) from None
        if len(key) < MIN_TIER_KEY_BYTES:
            raise ConfigError(
                f"tiers.tier_key_file: {self.tier_key_file} holds {len(key)} bytes, the tier key "
                f"needs at least {MIN_TIER_KEY_BYTES} (not counting whitespace); {make}"
            )
        return key


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
    # How "auto" knows the schemes' costs on this machine (SCHEME_CALIBRATIONS).
    scheme_calibration: str = "auto"
    attention_backend: str = "torch"
    max_model_len: int | None = None
    num_threads: int | None = None
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

    def __post_init__(self) -> None:
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
