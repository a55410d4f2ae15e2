"""DRAM tier: fixed slots, LRU order, refusals when full, pins, the bandwidth cap."""

from __future__ import annotations

import threading
import time

from cachesvc.kv.tiers.base import TierItem, make_tier
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.types import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def item(i: int, size: int = 100) -> TierItem:
    return TierItem(h(i), h(i - 1) if i else None, bytes([i % 256]) * size)


def test_put_get_contains_and_lru_order() -> None:
    tier = DramTier(capacity_mb=1000 / 2**20, slot_bytes=250)  # 4 slots
    assert tier.num_slots == 4
    assert tier.put([item(i) for i in range(3)]) == [h(0), h(1), h(2)]
    assert tier.contains_prefix([h(0), h(1), h(5), h(2)]) == 2
    assert tier.get([h(1), h(7)]) == [item(1).data, None]
    assert tier.oldest(10) == [h(0), h(2), h(1)]  # the hit moved h(1) to the back
    assert tier.entries() == {h(0): None, h(1): h(0), h(2): h(1)}
    assert tier.stats.hits == 1 and tier.stats.misses == 1


def test_full_or_oversized_puts_are_refused_not_evicted() -> None:
    tier = DramTier(capacity_mb=500 / 2**20, slot_bytes=250)  # 2 slots
    tier.put([item(0), item(1)])
    assert not tier.room_for(100)
    assert tier.put([item(2)]) == []  # the manager picks victims, not the tier
    assert tier.put([item(3, size=251)]) == [] and not tier.fits_at_all(251)
    assert tier.stats.rejected == 2
    assert tier.pop([h(0)]) == [item(0).data]
    assert tier.room_for(100) and tier.put([item(2)]) == [h(2)]
    assert tier.get([h(2)]) == [item(2).data]
    assert tier.stats.hits == 1  # a pop for demotion is not a hit


def test_put_of_a_held_block_only_touches_it() -> None:
    tier = make_tier("dram", capacity_mb=1, slot_bytes=128)
    tier.put([item(0), item(1)])
    tier.put([item(0)])
    assert tier.oldest(2) == [h(1), h(0)]
    assert tier.stats.stored == 2


def test_pins_count() -> None:
    tier = DramTier(capacity_mb=1, slot_bytes=128)
    tier.pin([h(1), h(1)])
    tier.unpin([h(1)])
    assert tier.is_pinned(h(1))
    tier.unpin([h(1)])
    assert not tier.is_pinned(h(1))


def test_bandwidth_cap_throttles_reads() -> None:
    tier = DramTier(capacity_mb=1, slot_bytes=100_000, cap_mb_per_s=1.0)
    tier.put([TierItem(h(0), None, b"x" * 100_000)])
    start = time.perf_counter()
    tier.get([h(0)])
    assert time.perf_counter() - start >= 0.09  # 100 kB at 1 MB/s


def test_borrowed_reads_are_views_and_hold_off_other_threads() -> None:
    tier = DramTier(capacity_mb=1, slot_bytes=128)
    tier.put([item(0), item(1)])
    [copy] = tier.get([h(0)])
    assert isinstance(copy, bytearray) and copy == item(0).data
    done = threading.Event()
    with tier.borrow():
        [view] = tier.get([h(1)])
        assert isinstance(view, memoryview) and view == item(1).data
        other = threading.Thread(target=lambda: (tier.get([h(0)]), done.set()))
        other.start()
        assert not done.wait(0.05)  # another thread waits while the views are out
    other.join(timeout=5)
    assert done.is_set()
    [after] = tier.get([h(1)])
    assert isinstance(after, bytearray)  # borrowing ended: copies again
