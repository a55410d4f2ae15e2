"""Administering the engine's KV cache outside the step loop: sizing the device pool,
starting the lower tiers, attaching peers, the operations run between steps (flush, purge,
close), and dropping the tier blocks a failed demotion left unreachable.

`blocks_for_budget` and `start_cache` run once, at the engine's start; `CacheAdmin` holds the
device pool, the tiers (None when off) and the deployment's tier key (read once, there), and
`Engine`'s cache operations delegate to it. Only the engine's thread calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.events import TIER_HBM
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from workers.config import EngineConfig
from workers.engine.kv_manager import KVCacheManager
from workers.engine.runner import ModelRunner
from workers.model.config import ModelConfig

if TYPE_CHECKING:
    from workers.engine.tiering.kv_tiering import KVTiering
    from workers.engine.tiering.peer import PeerLink


def blocks_for_budget(config: EngineConfig, model: ModelConfig, itemsize: int) -> int:
    """Device blocks whose keys and values, over every layer, fit `config.kv_cache_mb` (at
    least one), at `itemsize` bytes an element."""
    bytes_per_block = (
        model.num_layers * 2 * config.block_size * model.num_kv_heads * model.head_dim * itemsize
    )
    return max(1, config.kv_cache_mb * 2**20 // bytes_per_block)


def start_cache(
    config: EngineConfig,
    pool: BlockPool,
    kv: KVCacheManager,
    runner: ModelRunner,
    kv_caches: list[torch.Tensor],
    fingerprint: str,
) -> CacheAdmin:
    """The tier key (`--tier-key-file`: a bad file fails the start), and DRAM / NVMe / Redis
    below the device pool when configured (config.tiers), with the load planner they share
    with pulls from peers (`peer_pull`), hooked into `pool` and `kv` and calibrated when
    asked; no tiering when neither is on."""
    key = config.tiers.read_key()
    if not config.tiers.enabled and not config.peer_pull:
        return CacheAdmin(config, pool, None, key)
    from workers.engine.tiering.calibration import calibrate
    from workers.engine.tiering.kv_tiering import KVTiering

    tiering = KVTiering(config.tiers, pool, kv_caches, config.block_size, fingerprint, key)
    kv.tiering = tiering
    if config.tiers.calibrate:
        calibrate(tiering, runner, config.max_num_batched_tokens)
    return CacheAdmin(config, pool, tiering, key)


class CacheAdmin:
    """The device pool and the tiers below it, for the operations that span both."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        tiering: KVTiering | None,
        tier_key: bytes | None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.tiering = tiering
        # The deployment's secret (None without one): signs what leaves the process, blocks in
        # the tiers and chunks to peers alike. Read once, at start.
        self.tier_key = tier_key
        self._demote_failures_seen = 0  # of pool.num_evict_hook_failures, see after_evictions

    def attach_peers(self, link: PeerLink) -> None:
        """Pull blocks from peers through `link`; does nothing unless `peer_pull` is on."""
        if self.config.peer_pull and self.tiering is not None:
            c = self.config
            self.tiering.attach_peers(link, c.peer_pull_timeout_s, c.peer_digest)

    def close(self) -> None:
        """Demote what the device and DRAM cache to NVMe when there is an NVMe tier, then
        close the tiers (blocks until their background writes are done)."""
        if self.tiering is None:
            return
        manager = self.tiering.manager
        if any(tier.name == "nvme" for tier in manager.local):
            self.pool.reset_cache(demote=True)
            self.after_evictions()
            manager.spill()
        self.tiering.close()

    def flush(self) -> int:
        """Drop the device's unheld cached blocks (not demoted) and the tier blocks they
        orphan; returns how many device blocks were dropped."""
        dropped = self.pool.reset_cache(demote=False)
        if self.tiering is not None:
            self.tiering.manager.drop_orphans()
        return dropped

    def purge(self) -> dict[str, int]:
        """Drop the device's unheld cached blocks and everything in every tier; returns the
        blocks dropped per tier name ("hbm" for the device).

        This frees the room; it is not what makes a purge atomic across workers. The router has
        already moved to a new purge epoch (`cachesvc.kv.hashing.epoch_salt`), so nothing dropped
        here, nor anything a request of an older salt caches after it (held blocks of running
        requests, a pull in flight, a share queued for Redis), matches a later request."""
        counts = {TIER_HBM: self.pool.reset_cache(demote=False)}
        if self.tiering is not None:
            counts.update(self.tiering.manager.clear())
        return counts

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Tenants' soft shares and retention budgets, in the device pool and every local
        tier (a tenant not named has no quota)."""
        self.pool.set_quotas(quotas)
        if self.tiering is not None:
            self.tiering.manager.set_quotas(quotas)

    def close_session(self, tenant: str, session: str) -> int:
        """End the retentions of `tenant`'s `session` in the device pool and every local tier
        (they become ordinary cache); returns how many blocks, all tiers."""
        ended = self.pool.close_session(tenant, session)
        if self.tiering is not None:
            ended += self.tiering.manager.close_session(tenant, session)
        return ended

    def tenant_blocks(self) -> dict[str, dict[str, TenantBlocks]]:
        """Per tier name ("hbm" for the device), each tenant's cached and retained blocks."""
        out = {TIER_HBM: self.pool.tenant_blocks()}
        if self.tiering is not None:
            out.update(self.tiering.manager.tenant_blocks())
        return out

    def after_evictions(self) -> None:
        """When a demotion failed (a counted miss in the pool), its block left the device
        without reaching a tier: drop the blocks demoted below it earlier, which nothing can
        reach any more (the tiers keep no orphans). Call it after anything that may evict."""
        failures = self.pool.num_evict_hook_failures
        if self.tiering is not None and failures != self._demote_failures_seen:
            self._demote_failures_seen = failures
            self.tiering.manager.drop_orphans()
