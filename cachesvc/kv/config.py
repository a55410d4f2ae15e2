"""The cache core's frozen, validated configuration: the tiers (`TierConfig`), their codecs and
plan modes, and `ConfigError`, which every config of the house raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cachesvc.kv.eviction.base import POLICY_NAMES


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
    # The order DRAM and NVMe give up blocks in (`cachesvc.kv.eviction`; the manager still takes
    # leaves first). Redis keeps its TTLs and its own eviction.
    eviction_policy: str = "lru"

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
        check_policy("tiers.eviction_policy", self.eviction_policy)

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


def check_policy(name: str, value: str) -> None:
    """Refuse an eviction policy name that `cachesvc.kv.eviction` does not know."""
    if value not in POLICY_NAMES:
        raise ConfigError(
            f"{name} must be one of {POLICY_NAMES}, got {value!r} (--eviction-policy; "
            "`cachesvc simulate eviction` compares them)"
        )
