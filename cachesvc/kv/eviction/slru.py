"""Segmented LRU: a key used again while held is protected from keys seen once.

New keys enter *probation*; a key pulled (a hit) and pushed again enters *protected*, which
holds at most `protected_fraction` of the evictable keys (its least recent go back to
probation). Victims come from probation first, so a one-time scan of new blocks churns
probation and leaves a hot set in protected: scan resistant, where LRU lets the scan flush it.
The share is checked when a victim is asked for (`pop`, `peek`): a store still filling up
demotes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, register_policy


@register_policy("slru")
class Slru(EvictionPolicy[K]):
    """Probation and protected segments, each in LRU order; `to_front` keys go before both."""

    name = "slru"

    def __init__(self, protected_fraction: float = 0.8) -> None:
        assert 0 < protected_fraction < 1
        self.protected_fraction = protected_fraction
        self._first: OrderedDict[K, None] = OrderedDict()
        self._probation: OrderedDict[K, None] = OrderedDict()
        self._protected: OrderedDict[K, None] = OrderedDict()
        self._reused: set[K] = set()  # keys used again since they last entered probation

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        self._unlink(key)
        (self._protected if key in self._reused else self._probation)[key] = None

    def pull(self, key: K) -> None:
        self._unlink(key)
        self._reused.add(key)

    def to_front(self, key: K) -> None:
        self._unlink(key)
        self._first[key] = None
        self._first.move_to_end(key, last=False)

    def pop(self) -> K:
        self._rebalance()
        for segment in (self._first, self._probation, self._protected):
            if segment:
                key = segment.popitem(last=False)[0]
                self._reused.discard(key)
                return key
        raise IndexError("no evictable key")

    def discard(self, key: K) -> None:
        self._unlink(key)
        self._reused.discard(key)

    def _unlink(self, key: K) -> None:
        for segment in (self._first, self._probation, self._protected):
            if segment.pop(key, 1) is None:  # stored values are None: found and removed
                return

    def _rebalance(self) -> None:
        """Demote protected keys, least recent first, to probation's recent end while protected
        holds more than its share; a demoted key must be used again to come back."""
        limit = self.protected_fraction * len(self)
        while len(self._protected) > max(1.0, limit):
            key = self._protected.popitem(last=False)[0]
            self._reused.discard(key)
            self._probation[key] = None

    def __len__(self) -> int:
        return len(self._first) + len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._probation or key in self._protected

    def peek(self, limit: int) -> list[K]:
        """As the base's, after the demotions `pop` would make first."""
        self._rebalance()
        return super().peek(limit)

    def check_integrity(self) -> None:
        segments = (self._first, self._probation, self._protected)
        keys = [k for segment in segments for k in segment]
        assert len(keys) == len(set(keys)), "a key in two segments"
        assert self._reused.issuperset(self._protected), "a protected key not marked reused"

    def __iter__(self) -> Iterator[K]:
        yield from self._first
        yield from self._probation
        yield from self._protected
