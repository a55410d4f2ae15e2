"""The tiers a `TierConfig` asks for, built through the tier registry."""

from __future__ import annotations

from cachesvc.kv.config import TierConfig
from cachesvc.kv.tiers.base import Tier, make_tier


def build_tiers(
    config: TierConfig, fingerprint: str, block_bytes: int, *, pin_memory: bool = False
) -> tuple[list[Tier], Tier | None]:
    """The configured local tiers (fastest first) and shared tier (None without Redis);
    `block_bytes` sizes DRAM slots (an encoded block never exceeds raw + header), and
    `pin_memory` pins the DRAM tier for fast copies to a GPU. The Redis tier is namespaced by
    the model fingerprint, so workers of one model share it and no other model reads it."""
    local: list[Tier] = []
    if config.dram_mb > 0:
        local.append(
            make_tier(
                "dram",
                capacity_mb=config.dram_mb,
                slot_bytes=block_bytes,
                pin_memory=pin_memory,
                cap_mb_per_s=config.dram_cap_mbps,
                policy=config.eviction_policy,
            )
        )
    if config.nvme_path is not None:
        local.append(
            make_tier(
                "nvme",
                path=config.nvme_path,
                capacity_mb=config.nvme_mb,
                cap_mb_per_s=config.nvme_cap_mbps,
                policy=config.eviction_policy,
            )
        )
    shared = None
    if config.redis_url is not None:
        shared = make_tier(
            "redis",
            url=config.redis_url,
            namespace=fingerprint,
            password=config.redis_password,
            ttl_s=config.redis_ttl_s,
            timeout_s=config.redis_timeout_s,
            read_timeout_s=config.redis_read_timeout_s,
            retry_s=config.redis_retry_s,
            max_failures=config.redis_breaker_failures,
            queue_mb=config.redis_queue_mb,
            tls_ca_file=config.redis_tls_ca_file,
            cap_mb_per_s=config.redis_cap_mbps,
        )
    return local, shared
