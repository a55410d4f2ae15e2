"""Building the engine's tiers from its `TierConfig`: the tiers and their codecs under a
`TierManager`, and the cost model the planner starts from before calibration."""

from __future__ import annotations

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.calibration import CostTracker, default_tier_cost
from cachesvc.kv.codec import Codec, max_blob_size
from cachesvc.kv.config import AUTO_CODECS, TierConfig
from cachesvc.kv.planner import ComputeCost
from cachesvc.kv.tiers.configured import build_tiers
from cachesvc.kv.tiers.tier_manager import TierManager

_PRIOR_COMPUTE = ComputeCost(alpha_s=5e-3, beta_s=1e-3, gamma_s=1e-7)  # before calibration


def build_manager(
    config: TierConfig,
    pool: BlockPool,
    fingerprint: str,
    dtype: str,
    block_shape: tuple[int, ...],
    key: bytes | None,
) -> TierManager:
    """The configured tiers and their codecs for blocks of `block_shape`, their moves logged in
    `pool`'s events; blocks that leave the process are signed with `key` when there is one."""
    # "auto" starts uncompressed; calibration keeps the fastest lossless mode of each tier.
    modes = {n: AUTO_CODECS[0] if m == "auto" else m for n, m in config.codecs.items()}
    local, shared = build_tiers(
        config,
        fingerprint,
        # DRAM slots fit a block in its codec (a quantized one is ~1/4 of float32), with
        # room for either tag.
        max_blob_size(modes["dram"], dtype, block_shape, signed=True),
        pin_memory=torch.cuda.is_available(),
    )
    signed = {t.name for t in [*local, *([shared] if shared else [])] if t.outside_process}
    codecs = {
        name: Codec(fingerprint, mode, key if name in signed else None)
        for name, mode in modes.items()
    }
    return TierManager(
        local, shared, codecs, pool.events, config.redis_min_reuse, device_has=pool.contains
    )


def prior_costs(
    config: TierConfig, manager: TierManager, dtype: str, block_shape: tuple[int, ...]
) -> CostTracker:
    """The cost model until calibration: a prior per tier over the bytes of a block in its
    codec, under the tier's configured bandwidth cap."""
    costs = CostTracker(
        _PRIOR_COMPUTE,
        {
            t.name: default_tier_cost(
                t.name, manager.codecs[t.name].max_blob_size(dtype, block_shape)
            )
            for t in manager.all_tiers
        },
    )
    caps = {
        "dram": config.dram_cap_mbps,
        "nvme": config.nvme_cap_mbps,
        "redis": config.redis_cap_mbps,
    }
    for t in manager.all_tiers:
        costs.set_cap(t.name, caps[t.name])
    return costs
