"""S3-FIFO (Yang et al., SOSP'23): a small FIFO for new keys, a main FIFO, a ghost of keys
evicted from the small one.

A new key enters *small* (or *main*, when the ghost remembers it: it was evicted too early). A
victim is looked for in small while small holds at least `small_fraction` of the evictable
keys: a key used since it entered moves to main, any other is evicted (and remembered by the
ghost). In main a key used since it was last looked at gets another round (its count falls by
one); the first without one is evicted. One-time keys leave quickly through small, so a scan
does not flush the keys main holds.

The stores here take a key out while it is in use (`pull`) and give it back (`push`): it goes
back to the recent end of its own queue, so positions are by last use, not by insertion. The
device pool's keys are block ids: the ghost remembers their content (`push`'s `content`, the
block's hash), so a prefix computed again into another block is recognised. The tiers pick
their victims from `peek` and remove them (`discard`), so there the ghost stays empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, register_policy

_MAX_FREQ = 3


@register_policy("s3fifo")
class S3Fifo(EvictionPolicy[K]):
    """Small, main and ghost queues; `to_front` keys go before both. Amortized O(1): each
    second round in main spends one of at most `_MAX_FREQ` counts."""

    name = "s3fifo"

    # A small queue of 25% rather than the paper's 10%: measured (`cachesvc simulate eviction`),
    # 10% falls below LRU at 5% of the blocks on the trace and on conversations, 25% nowhere.
    # The ghost remembers `ghost_factor` times as many keys as are evictable.
    def __init__(self, small_fraction: float = 0.25, ghost_factor: float = 1.0) -> None:
        assert 0 < small_fraction < 1 and ghost_factor > 0
        self.small_fraction = small_fraction
        self.ghost_factor = ghost_factor
        self._first: OrderedDict[K, None] = OrderedDict()
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()  # contents evicted from small
        self._freq: dict[K, int] = {}  # every known key (evictable or in use): uses, capped
        self._in_main: set[K] = set()
        self._content: dict[K, Hashable] = {}  # known keys that are slots: what each holds

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        self._unlink(key)
        if content is not None:
            self._content[key] = content
        if key not in self._freq:
            self._freq[key] = 0
            if self._ghost.pop(self._content.get(key, key), 1) is None:
                self._in_main.add(key)
        (self._main if key in self._in_main else self._small)[key] = None

    def pull(self, key: K) -> None:
        self._unlink(key)
        self._freq[key] = min(self._freq.get(key, 0) + 1, _MAX_FREQ)

    def to_front(self, key: K) -> None:
        self._unlink(key)
        self._first[key] = None
        self._first.move_to_end(key, last=False)

    def pop(self) -> K:
        if self._first:
            key = self._first.popitem(last=False)[0]
        elif not self._small and not self._main:
            raise IndexError("no evictable key")
        else:
            self._settle()
            from_small = self._small_next()
            key = (self._small if from_small else self._main).popitem(last=False)[0]
            if from_small:
                self._ghost[self._content.get(key, key)] = None
                while len(self._ghost) > max(1, self.ghost_factor * len(self)):
                    self._ghost.popitem(last=False)
        self._forget(key)
        return key

    def peek(self, limit: int) -> list[K]:
        """As the base's, after the moves `pop` would make first (`_settle`), so the first key
        is `pop`'s victim; which keys are evictable does not change."""
        if not self._first and len(self):
            self._settle()
        return super().peek(limit)

    def _settle(self) -> None:
        """Make the moves that come before an eviction until the head of the queue to evict
        from is unused: a key used since it entered small moves to main, a key used since main
        last looked at it gets another round there (its count falls by one)."""
        while True:
            queue = self._small if self._small_next() else self._main
            head = next(iter(queue))
            if not self._freq[head]:
                return
            if queue is self._small:
                del self._small[head]
                self._freq[head] = 0
                self._in_main.add(head)
                self._main[head] = None
            else:
                self._freq[head] -= 1
                self._main.move_to_end(head)

    def _small_next(self) -> bool:
        """Whether the next victim is looked for in small."""
        return bool(self._small) and (
            len(self._small) >= self.small_fraction * len(self) or not self._main
        )

    def discard(self, key: K) -> None:
        """As the base's; the ghost forgets `key` too (a store's slot that held nothing)."""
        self._unlink(key)
        self._forget(key)
        self._ghost.pop(key, None)

    def _forget(self, key: K) -> None:
        self._freq.pop(key, None)
        self._in_main.discard(key)
        self._content.pop(key, None)

    def _unlink(self, key: K) -> None:
        for queue in (self._first, self._small, self._main):
            if queue.pop(key, 1) is None:  # stored values are None: found and removed
                return

    def __len__(self) -> int:
        return len(self._first) + len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._small or key in self._main

    def check_integrity(self) -> None:
        keys = [*self._first, *self._small, *self._main]
        assert len(keys) == len(set(keys)), "a key in two queues"
        assert all(k in self._freq for k in [*self._small, *self._main]), "a queued key unknown"
        assert all(k in self._in_main for k in self._main), "main holds a key of small"
        assert not any(k in self._in_main for k in self._small), "small holds a key of main"
        assert self._in_main.issubset(self._freq), "a main key unknown"
        assert set(self._content).issubset(self._freq), "the content of an unknown key"
        assert all(0 <= f <= _MAX_FREQ for f in self._freq.values())

    def __iter__(self) -> Iterator[K]:
        yield from self._first
        queues = (self._small, self._main) if self._small_next() else (self._main, self._small)
        for queue in queues:
            yield from (k for k in queue if not self._freq[k])
        for queue in queues:
            yield from (k for k in queue if self._freq[k])
