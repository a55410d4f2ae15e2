"""Least recently used: an ordered dict, the least recently pushed key first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, register_policy


@register_policy("lru")
class Lru(EvictionPolicy[K]):
    """The order keys were last pushed in; `pull` forgets nothing because LRU keeps no history."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def pull(self, key: K) -> None:
        self._order.pop(key, None)

    def to_front(self, key: K) -> None:
        self._order.move_to_end(key, last=False)

    def pop(self) -> K:
        if not self._order:
            raise IndexError("no evictable key")
        return self._order.popitem(last=False)[0]

    def discard(self, key: K) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def check_integrity(self) -> None:
        assert all(v is None for v in self._order.values())
