"""The device block pool: reference counts, an O(1) LRU of free blocks, and a hash map.

A block is the unit of paging and of prefix caching. A block with a reference count of zero sits
in the free queue; if it still holds a registered hash it is a *cached* free block that a later
request may revive, and it is evicted (its hash dropped) only when it is handed out again, least
recently freed first. No I/O and no policy live here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachesvc.events import TIER_HBM, EventLog
from cachesvc.types import BlockHash, BlockId


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when fewer free blocks remain than were asked for."""


@dataclass
class _Block:
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # kept to confirm a hash hit (collision guard)
    parent: BlockHash | None = None  # hash of the block before it, for the tiers' chains


# Called with (block id, hash, token ids, parent hash) just before a cached block loses its hash,
# while its KV is still intact: the tiers copy it out (demotion) before the block is reused.
EvictHook = Callable[[BlockId, BlockHash, tuple[int, ...], "BlockHash | None"], None]


class BlockPool:
    """Fixed set of `num_blocks` block ids with ref counts, LRU reuse and hash registration."""

    def __init__(self, num_blocks: int, events: EventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Insertion order is LRU order: the head is evicted first.
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(i), None) for i in range(num_blocks)
        )
        self._by_hash: dict[BlockHash, BlockId] = {}
        self.events = events if events is not None else EventLog()
        self.on_evict: EvictHook | None = None

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (cached free blocks included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a registered hash, in use or free."""
        return len(self._by_hash)

    def ref_count(self, block_id: BlockId) -> int:
        return self._blocks[block_id].ref_cnt

    def allocate(self, num: int) -> list[BlockId]:
        """Take `num` blocks (ref count 1), evicting cached free blocks LRU first.

        Raises NoFreeBlocksError, changing nothing, when fewer than `num` are free.
        """
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks, {len(self._free)} free")
        out: list[BlockId] = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference from each block; a block reaching zero joins the free queue.

        Blocks are freed in the given order, so pass a request's blocks tail first: the tail of
        a prefix is then evicted before its head.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Add a reference to each block, taking free ones out of the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def register(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
    ) -> None:
        """Record that `block_id` holds (or is about to hold) the KV of a full block.

        A hash that is already registered keeps its first block: the duplicate stays private.
        Emits BlockStored with `parent`, the hash of the block before it (None for the first).
        """
        block = self._blocks[block_id]
        assert block.ref_cnt > 0, "only an allocated block can be registered"
        if block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent = parent
        self._by_hash[block_hash] = block_id
        self.events.stored(TIER_HBM, (block_hash,), parent)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> BlockId | None:
        """The block registered under `block_hash` whose tokens equal `token_ids`, or None."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether some block is registered under `block_hash` (no collision check)."""
        return block_hash in self._by_hash

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def reset_cache(self) -> int:
        """Forget every hash of a free block; returns how many were dropped."""
        dropped = 0
        for block_id in list(self._free):
            if self._blocks[block_id].block_hash is not None:
                self._evict(block_id)
                dropped += 1
        if not self._by_hash:
            self.events.cleared(TIER_HBM)
        return dropped

    def _evict(self, block_id: BlockId) -> None:
        block = self._blocks[block_id]
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block.block_hash, block.token_ids, block.parent)
            del self._by_hash[block.block_hash]
            self.events.removed(TIER_HBM, (block.block_hash,))
            block.block_hash = None
            block.token_ids = ()
            block.parent = None

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool is broken."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for i, block in enumerate(self._blocks):
            assert block.ref_cnt >= 0, f"block {i} has negative ref count"
            assert (block.ref_cnt == 0) == (BlockId(i) in free), f"block {i} free-queue mismatch"
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) == i, f"block {i} hash not mapped"
        for block_hash, block_id in self._by_hash.items():
            assert self._blocks[block_id].block_hash == block_hash
