"""DRAM tier: a preallocated host buffer cut into fixed slots, given up in retention and quota
order, an eviction policy's within a retention class (`cachesvc.kv.eviction`: least recently
used first by default; see `retaining.RetainingTier`). A tenant's budget and share count slots.

One slot per block: every block of a model has the same size, so fixed slots never fragment
(LMCache#1285 is a fragmentation bug of a variable-size allocator). On CUDA the buffer is pinned,
so a promotion to the device is one DMA. The manager decides victims; this tier only refuses a
put when no slot is free.

A read copies each blob out of its slot, since a later demotion may reuse the slot; a caller that
lands the blocks at once can `borrow` the tier instead and read views of the slots, which saves
a copy of every byte (and the page faults of fresh buffers) on the request's path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import numpy as np

from cachesvc.kv.host_memory import host_buffer
from cachesvc.kv.retention_book import RetentionBook
from cachesvc.kv.tiers.base import TierItem, register_tier
from cachesvc.kv.tiers.retaining import RetainingTier
from cachesvc.kv.types import BlockHash


@dataclass
class _Slot:
    index: int
    length: int
    parent: BlockHash | None


def _host_buffer(num_bytes: int, pin: bool) -> np.ndarray:
    if pin:
        import torch  # only on CUDA machines: page-locked memory needs the CUDA runtime

        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True).numpy()
    # Faulted in on a background thread: a demotion into a never-touched slot would otherwise
    # pay the page faults on the request's path, ~8x a warm copy. Plain pages: slots are read
    # and written whole, and compaction for huge pages could stall the serving engine.
    return host_buffer(num_bytes, populate="background", huge_pages=False)


@register_tier("dram")
class DramTier(RetainingTier):
    """`capacity_mb` of host memory in slots of `slot_bytes` (the largest blob it accepts),
    victims offered in retention order over eviction policy `policy`; `clock` tells when a
    retention expires (wall clock)."""

    name = "dram"

    def __init__(
        self,
        capacity_mb: float,
        slot_bytes: int,
        pin_memory: bool = False,
        cap_mb_per_s: float | None = None,
        policy: str = "lru",
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(cap_mb_per_s)
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = int(capacity_mb * 2**20) // slot_bytes
        self._buf = _host_buffer(self.num_slots * slot_bytes, pin_memory)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slots: dict[BlockHash, _Slot] = {}
        self._book: RetentionBook[BlockHash] = RetentionBook(policy, self.num_slots, clock)
        self._num_borrows = 0  # > 0: the thread holding the lock reads views, not copies

    @contextmanager
    def borrow(self) -> Iterator[None]:
        """While open, `get` on this thread returns views of the slots instead of copies, and
        every other thread waits for the tier.

        The views are valid until the block closes: land the blocks inside it, and put nothing
        into the tier from this thread meanwhile (a put may reuse a slot under a view).
        """
        with self._lock:
            self._num_borrows += 1
            try:
                yield
            finally:
                self._num_borrows -= 1

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._slots:
                    break
                n += 1
            return n

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for h in hashes:
                slot = self._slots.get(h)
                if slot is None:
                    self.stats.misses += 1
                    out.append(None)
                    continue
                self._book.use(h, slot.parent)
                data = self._buf[slot.index * self.slot_bytes :][: slot.length]
                # A view when borrowed, else a bytearray: either is writable, so the codec decodes
                # a raw blob in place, without one more copy.
                view = data.data if self._num_borrows else bytearray(data)
                out.append(cast(bytes, view))
                self.stats.hits += 1
        num_bytes = sum(len(b) for b in out if b is not None)
        self.stats.bytes_read += num_bytes
        self.throttle.wait(num_bytes)
        return out

    def pop(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        # Demotion is off the request path: no throttle, and not counted as a hit.
        out: list[bytes | None] = []
        with self._lock:
            for h in hashes:
                slot = self._slots.pop(h, None)
                if slot is None:
                    out.append(None)
                    continue
                self._book.remove(h)
                start = slot.index * self.slot_bytes
                out.append(self._buf[start : start + slot.length].tobytes())
                self._free.append(slot.index)
                self.stats.removed += 1
        return out

    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        stored: list[BlockHash] = []
        with self._lock:
            for item in items:
                if item.block_hash in self._slots:
                    self._touch(item)
                    stored.append(item.block_hash)
                    continue
                if len(item.data) > self.slot_bytes or not self._free:
                    self.stats.rejected += 1
                    continue
                index = self._free.pop()
                start = index * self.slot_bytes
                self._buf[start : start + len(item.data)] = np.frombuffer(item.data, np.uint8)
                self._slots[item.block_hash] = _Slot(index, len(item.data), item.parent)
                self._add(item, 1)
                self.stats.stored += 1
                self.stats.bytes_written += len(item.data)
                stored.append(item.block_hash)
        return stored

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                slot = self._slots.pop(h, None)
                if slot is not None:
                    self._book.remove(h)
                    self._free.append(slot.index)
                    self.stats.removed += 1

    def room_for(self, num_bytes: int) -> bool:
        with self._lock:
            return num_bytes <= self.slot_bytes and bool(self._free)

    def fits_at_all(self, num_bytes: int) -> bool:
        return num_bytes <= self.slot_bytes and self.num_slots > 0

    def entries(self) -> dict[BlockHash, BlockHash | None]:
        with self._lock:
            return {h: self._slots[h].parent for h in self._book}

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            book = self._book
            self._book = RetentionBook(book.policy, book.capacity, book.clock)
            self._book.set_quotas(book.quotas)
            self._free = list(range(self.num_slots - 1, -1, -1))
