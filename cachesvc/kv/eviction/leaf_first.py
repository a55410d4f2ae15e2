"""Leaf-first LRU: inside a prefix chain the tail goes before the prefix others share.

A key with a known child (a block pushed with it as `parent`, not evicted since) is not a leaf:
victims are the least recently used *leaves*, and a key is taken while it still has children
only when no leaf is evictable. So a conversation's last block leaves before the system prompt
every conversation starts with, however the two were last used, and no block is evicted while
a block that extends it stays behind (unreachable, as a match stops at the first miss).

Two heaps of (recency stamp, key), validated lazily on `pop`: O(log n) per operation.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, register_policy


@register_policy("leaf_lru")
class LeafFirstLru(EvictionPolicy[K]):
    """LRU among leaves, then LRU among the rest; `to_front` keys before either."""

    name = "leaf_lru"

    def __init__(self) -> None:
        self._stamp: dict[K, int] = {}  # evictable key -> when it was last pushed
        self._clock = 0
        self._front_clock = 0  # `to_front` stamps count down from here, below every push
        self._leaves: list[tuple[int, K]] = []  # candidates; an entry is stale once re-stamped
        self._all: list[tuple[int, K]] = []
        self._parent: dict[K, K] = {}
        self._children: dict[K, set[K]] = {}

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        if parent is not None and key not in self._parent and parent != key:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)
        self._clock += 1
        self._stamp_as(key, self._clock)

    def pull(self, key: K) -> None:
        self._stamp.pop(key, None)  # its heap entries go stale

    def to_front(self, key: K) -> None:
        assert key in self._stamp, "only an evictable key can move to the front"
        self._front_clock -= 1
        self._stamp_as(key, self._front_clock)

    def pop(self) -> K:
        key = self._pop_valid(self._leaves, leaves_only=True)
        if key is None:
            key = self._pop_valid(self._all, leaves_only=False)
        if key is None:
            raise IndexError("no evictable key")
        self.discard(key)
        return key

    def discard(self, key: K) -> None:
        self._stamp.pop(key, None)
        for child in self._children.pop(key, ()):
            del self._parent[child]
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        siblings = self._children[parent]
        siblings.discard(key)
        if not siblings:
            del self._children[parent]
            if parent in self._stamp:  # it just became a leaf
                heapq.heappush(self._leaves, (self._stamp[parent], parent))

    def _stamp_as(self, key: K, stamp: int) -> None:
        self._stamp[key] = stamp
        heapq.heappush(self._all, (stamp, key))
        if not self._children.get(key):
            heapq.heappush(self._leaves, (stamp, key))
        if len(self._all) > 2 * len(self._stamp) + 64:
            self._compact()

    def _pop_valid(self, heap: list[tuple[int, K]], leaves_only: bool) -> K | None:
        while heap:
            stamp, key = heapq.heappop(heap)
            if self._stamp.get(key) != stamp:
                continue
            if leaves_only and self._children.get(key):
                continue  # it got a child since: it waits in `_all`
            return key
        return None

    def _compact(self) -> None:
        """Rebuild both heaps from the live stamps (stale entries pile up as keys move)."""
        self._all = [(s, k) for k, s in self._stamp.items()]
        heapq.heapify(self._all)
        self._leaves = [(s, k) for s, k in self._all if not self._children.get(k)]
        heapq.heapify(self._leaves)

    def check_integrity(self) -> None:
        for child, parent in self._parent.items():
            assert child in self._children.get(parent, ()), f"{child!r} missing from its parent"
        for parent, children in self._children.items():
            assert children, "an empty child set is kept"
            assert all(self._parent.get(c) == parent for c in children), "a stale child link"
        live = {(s, k) for k, s in self._stamp.items()}
        assert live.issubset(self._all), "an evictable key missing from the heap"
        leaves = {(s, k) for s, k in live if not self._children.get(k)}
        assert leaves.issubset(self._leaves), "an evictable leaf missing from the leaf heap"

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: object) -> bool:
        return key in self._stamp

    def __iter__(self) -> Iterator[K]:
        return iter(self.peek(len(self._stamp)))

    def peek(self, limit: int) -> list[K]:
        ranked = heapq.nsmallest(
            limit, self._stamp.items(), key=lambda kv: (bool(self._children.get(kv[0])), kv[1])
        )
        return [k for k, _ in ranked]
