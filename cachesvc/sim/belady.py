"""Belady's offline optimum, the limit an eviction policy is measured against: the victim is the
block whose next use lies farthest in the future (never used again first).

It reads the future from the replayed requests themselves, so it is a policy only for the
replay (`cachesvc.sim.eviction`), never for a store; so is `ReuseOracle`, which knows only
whether a block is used again. Blocks next used by the same request go
deepest first: a prefix always outlives its extensions, so every block it keeps is reachable.
A heap with lazy deletion: O(log n) per operation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterator, Sequence

from cachesvc.kv.eviction.base import EvictionPolicy
from cachesvc.kv.types import BlockHash
from cachesvc.sim.trace import SimRequest

_Entry = tuple[float, int, int, BlockHash]  # (-next use, -depth, sequence, key)


def next_uses(requests: Sequence[SimRequest]) -> list[dict[BlockHash, float]]:
    """Per request, for each of its full blocks, the index of the next request using it (inf
    when none does)."""
    later: dict[BlockHash, float] = {}
    out: list[dict[BlockHash, float]] = [{} for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        blocks = requests[i].hashes[: requests[i].num_full_blocks]
        out[i] = {h: later.get(h, math.inf) for h in blocks}
        for h in blocks:
            later[h] = i
    return out


class Belady(EvictionPolicy[BlockHash]):
    """Evicts the key used again last; `begin(i)` before request i's keys are pushed."""

    name = "belady"

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self._future = next_uses(requests)
        self._now: dict[BlockHash, float] = {}
        self._depth: dict[BlockHash, int] = {}
        self._entry: dict[BlockHash, _Entry] = {}  # evictable key -> its live heap entry
        self._heap: list[_Entry] = []
        self._seq = itertools.count()

    def begin(self, index: int, request: SimRequest) -> None:
        """Request `index` is being served: its blocks' next uses are after it."""
        self._now = self._future[index]
        self._depth = {h: d for d, h in enumerate(request.hashes[: request.num_full_blocks])}

    def push(
        self, key: BlockHash, parent: BlockHash | None = None, content: Hashable = None
    ) -> None:
        entry = (-self._now.get(key, math.inf), -self._depth.get(key, 0), next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)

    def pull(self, key: BlockHash) -> None:
        self._entry.pop(key, None)

    def to_front(self, key: BlockHash) -> None:
        # The next victim whatever its future: ahead of every entry, even one never used again.
        entry = (-math.inf, -(1 << 62), next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)

    def pop(self) -> BlockHash:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[3]) is entry:
                del self._entry[entry[3]]
                return entry[3]
        raise IndexError("no evictable key")

    def discard(self, key: BlockHash) -> None:
        self._entry.pop(key, None)

    def check_integrity(self) -> None:
        queued = set(self._heap)
        assert all(e in queued and e[3] == k for k, e in self._entry.items()), "an entry lost"

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(sorted(self._entry, key=self._entry.__getitem__))


class ReuseOracle(Belady):
    """LRU that knows which blocks are never used again, but not when the others will be:
    those go first, then the rest in LRU order. Between LRU and Belady, it splits Belady's lead
    into knowing who comes back (this) and knowing when (the rest). A policy only for the
    replay, as Belady."""

    name = "reuse_oracle"

    def push(
        self, key: BlockHash, parent: BlockHash | None = None, content: Hashable = None
    ) -> None:
        used_again = self._now.get(key, math.inf) < math.inf
        entry = (float(used_again), 0, next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
