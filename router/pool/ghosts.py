"""The blocks the workers recently let go of, so a miss can say "evicted" rather than "never
cached" (`router.request.explain`).

Fed by `IndexSync` with the events it applies: a `BlockRemoved` makes the hash a ghost, a
`BlockStored` (or the destination of a `BlockMoved`) lays it to rest. A ghost is recorded on every
removal, even when another tier or worker still holds the block: whoever reads a ghost asks the
index first, so a stale ghost of a held block is never reported. A `Cleared` tier names no hashes
and leaves no ghosts.

Beside it, when each hash's retention (if a request asked one) runs out: a block removed after
that moment was evicted because its retention expired, which the ghost remembers. Both maps are
bounded and forget their least recently touched entries first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Event
from cachesvc.kv.types import BlockHash

_V = TypeVar("_V")

DEFAULT_MAX_GHOSTS = 100_000  # about 6 MB of 32-byte hashes, plus the dicts' overhead


@dataclass(frozen=True)
class Ghost:
    """A block no longer held where it was: `expired` when a retention covered it and had run
    out when it was removed."""

    expired: bool


class GhostRecord:
    """Recently removed block hashes (at most `max_entries`) and retention expiries (as many).

    `clock` is monotonic seconds (the tests pass their own). Not thread-safe: the router calls it
    from its event loop only.
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_GHOSTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_entries > 0, "a ghost record needs room for at least one hash"
        self.max_entries = max_entries
        self._clock = clock
        self._ghosts: OrderedDict[BlockHash, Ghost] = OrderedDict()
        self._retained_until: OrderedDict[BlockHash, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ghosts)

    def get(self, block_hash: BlockHash) -> Ghost | None:
        """The ghost of `block_hash`, or None when it was never removed (or was stored since,
        or forgotten). No mutation."""
        return self._ghosts.get(block_hash)

    def retained(self, hashes: Iterable[BlockHash], retention_s: float) -> None:
        """A request asked these blocks be kept for `retention_s` from now; a longer retention
        already recorded wins."""
        until = self._clock() + retention_s
        for block_hash in hashes:
            known = self._retained_until.pop(block_hash, until)
            self._retained_until[block_hash] = max(known, until)
            _trim(self._retained_until, self.max_entries)

    def observe(self, events: Sequence[Event]) -> None:
        """Record what applied events say was removed and stored, in their order."""
        for event in events:
            if isinstance(event, BlockRemoved):
                self._removed(event.block_hashes)
            elif isinstance(event, (BlockStored, BlockMoved)):
                self._stored(event.block_hashes)

    def _removed(self, hashes: Iterable[BlockHash]) -> None:
        now = self._clock()
        for block_hash in hashes:
            until = self._retained_until.get(block_hash)
            self._ghosts.pop(block_hash, None)  # a removal again: the newest entry
            self._ghosts[block_hash] = Ghost(expired=until is not None and until <= now)
            _trim(self._ghosts, self.max_entries)

    def _stored(self, hashes: Iterable[BlockHash]) -> None:
        for block_hash in hashes:
            self._ghosts.pop(block_hash, None)

    def check_integrity(self) -> None:
        """Raise AssertionError when a map is over its bound."""
        assert len(self._ghosts) <= self.max_entries, "ghosts over their bound"
        assert len(self._retained_until) <= self.max_entries, "retentions over their bound"


def _trim(entries: OrderedDict[BlockHash, _V], max_entries: int) -> None:
    while len(entries) > max_entries:
        entries.popitem(last=False)
