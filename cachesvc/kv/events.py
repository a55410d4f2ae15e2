"""Changes of what a worker holds, as a stream the router's prefix index is a pure function of.

Each event carries the worker, the tier and a per-worker sequence number; a consumer that sees a
gap in sequence numbers must resync from a snapshot. Events cross processes through Redis Streams
when Redis is configured (`cachesvc/kv/events_redis.py`), through Ray polls otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cachesvc.kv.types import BlockHash

TIER_HBM = "hbm"  # the device pool, whatever the device (HBM on a GPU, host memory on a CPU)


@dataclass(frozen=True)
class BlockStored:
    """Blocks now held, in prefix order: `parent` is the hash before `block_hashes[0]`."""

    seq: int
    tier: str
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None = None


@dataclass(frozen=True)
class BlockRemoved:
    seq: int
    tier: str
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockMoved:
    seq: int
    block_hashes: tuple[BlockHash, ...]
    src_tier: str
    dst_tier: str


@dataclass(frozen=True)
class Cleared:
    """Everything in `tier` is gone (a flush or a restart)."""

    seq: int
    tier: str


Event = BlockStored | BlockRemoved | BlockMoved | Cleared


class EventLog:
    """Numbers events and buffers them until drained; one per worker.

    At most `max_pending` are kept: when nobody drains, the oldest are dropped, and the gap in
    sequence numbers tells a late consumer to resync from a snapshot.
    """

    def __init__(self, max_pending: int = 65536) -> None:
        self._next_seq = 0
        self._pending: deque[Event] = deque(maxlen=max_pending)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def stored(self, tier: str, hashes: tuple[BlockHash, ...], parent: BlockHash | None) -> None:
        self._pending.append(BlockStored(self._take(), tier, hashes, parent))

    def removed(self, tier: str, hashes: tuple[BlockHash, ...]) -> None:
        self._pending.append(BlockRemoved(self._take(), tier, hashes))

    def moved(self, hashes: tuple[BlockHash, ...], src: str, dst: str) -> None:
        self._pending.append(BlockMoved(self._take(), hashes, src, dst))

    def cleared(self, tier: str) -> None:
        self._pending.append(Cleared(self._take(), tier))

    def drain(self) -> list[Event]:
        """Return and forget the buffered events, oldest first."""
        out = list(self._pending)
        self._pending.clear()
        return out

    def _take(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq
