"""The device pool's eviction hook demotes a block with its retention: device -> DRAM -> NVMe,
read from the pool (`retention_of`) while the hook runs."""

from __future__ import annotations

from pathlib import Path

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.codec import Codec
from cachesvc.kv.events import EventLog
from cachesvc.kv.quotas import TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.tiering.writes import TierWriter

FP = "12" * 16
CODECS = {"dram": Codec(FP, "raw"), "nvme": Codec(FP, "raw")}
NUM_BLOCKS = 4


class RetainingPool(BlockPool):
    """A pool that says each block's retention, as the device pool does."""

    def __init__(self) -> None:
        super().__init__(NUM_BLOCKS)
        self.retentions: dict[BlockId, Retention] = {}

    def retention_of(self, block_id: BlockId) -> Retention | None:
        return self.retentions.get(block_id)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_the_evict_hook_demotes_with_the_blocks_retention(tmp_path: Path) -> None:
    caches = [torch.arange(NUM_BLOCKS * 8, dtype=torch.float32).reshape(NUM_BLOCKS, 2, 1, 1, 4)]
    pool = RetainingPool()
    blob = len(CODECS["dram"].encode(h(0), None, "float32", caches[0][0:1].numpy()))
    dram = DramTier(capacity_mb=(blob + 64) / 2**20, slot_bytes=blob + 64)  # one block
    nvme = NvmeTier(tmp_path, capacity_mb=8 * blob / 2**20)
    manager = TierManager([dram, nvme], None, CODECS, EventLog())
    manager.set_quotas({"t": TenantQuota(retention_share=1.0)})
    writer = TierWriter(manager, pool, caches, "float32")
    far = 2e9  # wall-clock seconds: far in the future
    pool.retentions[BlockId(0)] = Retention(SHORT, far, "t", "s")
    pool.retentions[BlockId(1)] = Retention(LONG, far, "t")
    writer.on_evict(BlockId(0), h(0), (), None)
    assert dram.retention_of(h(0)) == Retention(SHORT, far, "t", "s")
    writer.on_evict(BlockId(1), h(1), (), None)  # outranks the short one: it moves down
    assert manager.held_locally(h(0)) == {"nvme"} and manager.held_locally(h(1)) == {"dram"}
    assert nvme.retention_of(h(0)) == Retention(SHORT, far, "t", "s")
    assert dram.retention_of(h(1)) == Retention(LONG, far, "t")
    writer.on_evict(BlockId(2), h(2), (), None)  # unretained: DRAM's block outranks it
    assert manager.held_locally(h(2)) == {"nvme"} and nvme.retention_of(h(2)) is None
    assert manager.close_session("t", "s") == 1 and nvme.retention_of(h(0)) is None
    manager.check_integrity()
    manager.close()
