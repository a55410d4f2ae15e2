"""The blocks that leave the device for the tiers (`TierWriter`): demoted when the pool evicts
them, shared once they are popular.

* Demote: the block pool calls `on_evict` just before a cached block is reused; its KV is copied
  out of the device caches and handed to the `TierManager` (DRAM, then NVMe).
* Share: `note_reuse` counts the reuses of the blocks a request matched or loaded; a block
  reused `redis_min_reuse` times is written to Redis for the other workers. One a local tier
  holds is shared from there at once; one only on the device is queued and copied out after the
  step's compute (`share_queued`), since a block matched in the step it is computed in has no KV
  yet.
* A block leaves with its retention (`BlockPool.retention_of`, readable during the hook), which
  the tiers keep it by; one shared to Redis lives there at least until its retention ends.
* A block the pool marks lossy (`BlockPool.is_lossy`) leaves as lossy KV: the manager stores it
  only under a quantized codec (and is not even copied out for a lossless shared tier).

Only the engine's thread calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.codec import KVBlock
from cachesvc.kv.retention import Retention
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.kv_copy import layered, read_block


class TierWriter:
    """Copies device blocks down to the tiers: the pool's eviction hook and the share queue."""

    def __init__(
        self, manager: TierManager, pool: BlockPool, kv_caches: list[torch.Tensor], dtype: str
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.kv_caches = kv_caches
        self.dtype = dtype
        self._whole = layered(kv_caches)  # one strided copy per block
        self._queue: list[tuple[BlockHash, BlockId, BlockHash | None]] = []

    @torch.inference_mode()
    def on_evict(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent: BlockHash | None,
    ) -> None:
        """The pool is about to reuse a cached block: copy its KV down a tier first."""
        block = self._kv_block(block_id, block_hash, parent)
        self.manager.demote(block, self._retention(block_id), self.pool.tenant_of(block_id))

    def _retention(self, block_id: BlockId) -> Retention | None:
        """The block's retention in the pool (readable in the eviction hook), or None."""
        return self.pool.retention_of(block_id)

    def note_reuse(
        self, hashes: list[BlockHash], block_ids: Sequence[BlockId], parent: BlockHash | None
    ) -> None:
        """Count reuses; blocks that became popular are shared after this step's compute.

        `hashes` is a run of a chain held in `block_ids`; `parent` is the hash before it.
        """
        where = {h: i for i, h in enumerate(hashes)}
        for h in self.manager.note_reuse(hashes):
            if self.manager.held_locally(h):
                self.manager.share_held(h)
                continue
            i = where[h]
            if self.pool.is_lossy(block_ids[i]) and not self.manager.shares_lossy:
                continue  # the shared tier would refuse it: not worth the copy
            self._queue.append((h, block_ids[i], hashes[i - 1] if i else parent))

    @torch.inference_mode()
    def share_queued(self) -> None:
        """Share the queued blocks still on the device (their KV is written by now); empties
        the queue."""
        queue, self._queue = self._queue, []
        for block_hash, block_id, parent in queue:
            if self.pool.block_hash(block_id) == block_hash:  # not evicted since
                block = self._kv_block(block_id, block_hash, parent)
                self.manager.share(block, self._retention(block_id))

    def _kv_block(
        self, block_id: BlockId, block_hash: BlockHash, parent: BlockHash | None
    ) -> KVBlock:
        """A copy of a device block's KV, lossy when the pool marks it so."""
        array = read_block(self.kv_caches, block_id, self._whole)
        return KVBlock(block_hash, parent, self.dtype, array, self.pool.is_lossy(block_id))
