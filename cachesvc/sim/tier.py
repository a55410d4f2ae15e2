"""The lower tiers of a simulated worker: the real `TierManager` over tiers that count blocks.

A simulated block has no KV, so a tier here stores a tiny stand-in blob per block (the real
codec's encoding of a one-element array) and has room for a number of blocks rather than bytes.
Everything that decides where blocks go (demotion down the chain, leaf-first LRU victims,
orphans dropped with their prefix, the events the index is fed) is the manager's own code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice

import numpy as np

from cachesvc.kv.codec import Codec, KVBlock
from cachesvc.kv.events import EventLog
from cachesvc.kv.tiers.base import Tier, TierItem
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash

_DTYPE = "float16"
_STAND_IN = np.zeros(1, dtype=np.float16)  # the "KV" of every simulated block


class CountingTier(Tier):
    """A worker-local tier with room for `capacity_blocks` blocks, least recently used first."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        super().__init__()
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._blobs: OrderedDict[BlockHash, tuple[BlockHash | None, bytes]] = OrderedDict()

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blobs:
                break
            n += 1
        return n

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for h in hashes:
            entry = self._blobs.get(h)
            if entry is None:
                self.stats.misses += 1
                out.append(None)
                continue
            self._blobs.move_to_end(h)
            self.stats.hits += 1
            out.append(entry[1])
        return out

    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        stored = []
        for item in items:
            if item.block_hash in self._blobs:
                self._blobs.move_to_end(item.block_hash)
            elif len(self._blobs) >= self.capacity_blocks:
                self.stats.rejected += 1
                continue
            else:
                self._blobs[item.block_hash] = (item.parent, item.data)
                self.stats.stored += 1
            stored.append(item.block_hash)
        return stored

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if self._blobs.pop(h, None) is not None:
                self.stats.removed += 1

    def room_for(self, num_bytes: int) -> bool:
        return len(self._blobs) < self.capacity_blocks

    def fits_at_all(self, num_bytes: int) -> bool:
        return self.capacity_blocks > 0

    def oldest(self, limit: int) -> list[BlockHash]:
        return list(islice(self._blobs, limit))

    def entries(self) -> dict[BlockHash, BlockHash | None]:
        return {h: parent for h, (parent, _) in self._blobs.items()}


def build_manager(
    dram_blocks: int, nvme_blocks: int, events: EventLog, device_has: Callable[[BlockHash], bool]
) -> TierManager | None:
    """The tier manager of one simulated worker (DRAM, then NVMe); None when both are 0."""
    local: list[Tier] = []
    if dram_blocks > 0:
        local.append(CountingTier("dram", dram_blocks))
    if nvme_blocks > 0:
        local.append(CountingTier("nvme", nvme_blocks))
    if not local:
        return None
    codecs = {t.name: Codec("simulated", "raw") for t in local}
    return TierManager(local, None, codecs, events, device_has=device_has)


def stand_in_block(block_hash: BlockHash, parent: BlockHash | None) -> KVBlock:
    """The block a simulated device hands the tiers when it evicts `block_hash`."""
    return KVBlock(block_hash, parent, _DTYPE, _STAND_IN)
