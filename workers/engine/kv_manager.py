"""Block tables of requests over the device block pool."""

from __future__ import annotations

from cachesvc.block_pool import BlockPool
from workers.engine.request import Request


class KVCacheManager:
    """Gives each request the blocks its tokens need and takes them back."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request.block_ids` to hold `num_new_tokens` more tokens.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        total = request.num_computed_tokens + num_new_tokens
        need = self.num_blocks_for(total) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, tail first so the prefix head is evicted last."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
