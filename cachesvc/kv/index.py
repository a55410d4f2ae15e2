"""The router's prefix index: which worker holds which block, in which tier.

A pure function of each worker's event stream (`cachesvc.kv.events`) plus a snapshot to resync from:
`apply` takes events in sequence order and reports a gap instead of guessing, and `resync`
replaces a worker's entries with a snapshot. Because a block hash names its whole prefix, a
request's longest cached prefix on a worker is the run of its leading hashes that worker holds.

The index also keeps the purge epoch (`cachesvc.kv.hashing.epoch_salt`): the number of purges,
which the hashes of every request include, stored where the entries are so that routers sharing
an index agree on it. An index that cannot read it says so (`PurgeEpochUnknown`) rather than
answer the last value it read, which another router's purge may have ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.types import BlockHash, WorkerId

# Fastest first: a block held in several tiers counts in the fastest.
TIER_ORDER = ("hbm", "dram", "nvme", "redis")


def _tier_rank(tier: str) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


class PurgeEpochUnknown(ConnectionError):
    """The purge epoch cannot be read now (the shared index does not answer): a request must
    then reuse no cached block, since another router may have purged the epoch it last read."""


@dataclass(frozen=True)
class PrefixMatch:
    """A worker's longest cached prefix of a request: `num_blocks` leading blocks.

    `blocks_by_tier` says where they are (each block counted once, in its fastest tier).
    """

    worker: WorkerId
    num_blocks: int
    blocks_by_tier: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class IndexSnapshot:
    """Everything a worker holds, as of just before event `next_seq`.

    `incarnation` names one life of the worker process: a restarted worker numbers its events
    from zero again, so its events only continue a stream of the same incarnation.
    """

    incarnation: str
    next_seq: int
    blocks: Mapping[str, Sequence[BlockHash]]  # tier -> hashes


class PrefixIndex(Protocol):
    """Longest cached prefix per worker, kept from the workers' event streams."""

    num_epoch_unknown: int  # purge_epoch calls that raised PurgeEpochUnknown

    def apply(self, worker: WorkerId, incarnation: str, events: Sequence[Event]) -> bool:
        """Apply events in order; False, applying nothing past it, on a gap or unknown
        incarnation: the caller must `resync` the worker from a snapshot."""
        ...

    def resync(self, worker: WorkerId, snapshot: IndexSnapshot) -> None:
        """Replace everything known about `worker` by the snapshot."""
        ...

    def drop_worker(self, worker: WorkerId) -> None:
        """Forget a worker (dead or removed); unknown workers are ignored."""
        ...

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        """Each worker holding at least the first block, with its matched prefix; no mutation."""
        ...

    def num_blocks(self, worker: WorkerId) -> int:
        """How many distinct blocks `worker` holds in any tier (0 for an unknown worker)."""
        ...

    def next_seq(self, worker: WorkerId) -> int | None:
        """The sequence number of the next event expected from `worker`; None if unknown."""
        ...

    def purge_epoch(self) -> int:
        """The current purge epoch (0 before any purge); never goes down. Raises
        PurgeEpochUnknown when it cannot be read now: the last value read may be stale."""
        ...

    def advance_purge_epoch(self) -> int:
        """Start a new purge epoch and return it; raises when it cannot be stored (the purge
        must then fail: its caller would go on hashing under the old epoch)."""
        ...


@dataclass
class _Stream:
    incarnation: str
    next_seq: int


class MemoryPrefixIndex:
    """`PrefixIndex` in one process: hash -> worker -> tiers, plus each worker's hash set.

    `_fastest` mirrors `_by_hash` with each holder's fastest tier only, so a lookup reads one
    dict per block and scans each worker's run with list operations, not Python per block.
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, dict[WorkerId, set[str]]] = {}
        self._fastest: dict[BlockHash, dict[WorkerId, str]] = {}
        self._by_worker: dict[WorkerId, set[BlockHash]] = {}
        self._streams: dict[WorkerId, _Stream] = {}
        self._purge_epoch = 0
        self.num_epoch_unknown = 0  # always: this index is the only copy of its epoch

    # ---- updates ----------------------------------------------------------------------------

    def apply(self, worker: WorkerId, incarnation: str, events: Sequence[Event]) -> bool:
        stream = self._streams.get(worker)
        if stream is None or stream.incarnation != incarnation:
            return False
        for event in events:
            if event.seq < stream.next_seq:
                continue  # already covered by the snapshot or an earlier batch
            if event.seq > stream.next_seq:
                return False
            self._apply_one(worker, event)
            stream.next_seq += 1
        return True

    def resync(self, worker: WorkerId, snapshot: IndexSnapshot) -> None:
        self.drop_worker(worker)
        self._streams[worker] = _Stream(snapshot.incarnation, snapshot.next_seq)
        self._by_worker[worker] = set()
        for tier, hashes in snapshot.blocks.items():
            self._add(worker, tier, hashes)

    def drop_worker(self, worker: WorkerId) -> None:
        for block_hash in self._by_worker.pop(worker, set()):
            holders = self._by_hash[block_hash]
            del holders[worker]
            del self._fastest[block_hash][worker]
            if not holders:
                del self._by_hash[block_hash]
                del self._fastest[block_hash]
        self._streams.pop(worker, None)

    def _apply_one(self, worker: WorkerId, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._add(worker, event.tier, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._remove(worker, event.tier, event.block_hashes)
        elif isinstance(event, BlockMoved):
            self._remove(worker, event.src_tier, event.block_hashes)
            self._add(worker, event.dst_tier, event.block_hashes)
        elif isinstance(event, Cleared):
            held = [
                h for h in self._by_worker.get(worker, ()) if event.tier in self._tiers(h, worker)
            ]
            self._remove(worker, event.tier, held)

    def _tiers(self, block_hash: BlockHash, worker: WorkerId) -> set[str]:
        return self._by_hash.get(block_hash, {}).get(worker, set())

    def _add(self, worker: WorkerId, tier: str, hashes: Iterable[BlockHash]) -> None:
        owned = self._by_worker.setdefault(worker, set())
        for block_hash in hashes:
            tiers = self._by_hash.setdefault(block_hash, {}).setdefault(worker, set())
            tiers.add(tier)
            self._fastest.setdefault(block_hash, {})[worker] = min(tiers, key=_tier_rank)
            owned.add(block_hash)

    def _remove(self, worker: WorkerId, tier: str, hashes: Iterable[BlockHash]) -> None:
        for block_hash in hashes:
            holders = self._by_hash.get(block_hash, {})
            tiers = holders.get(worker)
            if tiers is None or tier not in tiers:
                continue  # removing what was never stored is harmless (e.g. after a resync)
            tiers.discard(tier)
            fastest = self._fastest[block_hash]
            if tiers:
                fastest[worker] = min(tiers, key=_tier_rank)
                continue
            del holders[worker]
            del fastest[worker]
            self._by_worker[worker].discard(block_hash)
            if not holders:
                del self._by_hash[block_hash]
                del self._fastest[block_hash]

    # ---- queries ----------------------------------------------------------------------------

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        # The leading blocks somebody holds; a worker's prefix lies within them.
        run: list[dict[WorkerId, str]] = []
        for block_hash in hashes:
            holders = self._fastest.get(block_hash)
            if not holders:
                break
            run.append(holders)
        out: dict[WorkerId, PrefixMatch] = {}
        for worker in run[0] if run else ():
            tiers = [holders.get(worker) for holders in run]
            num_blocks = tiers.index(None) if None in tiers else len(tiers)
            per_tier = Counter(tiers[:num_blocks])
            out[worker] = PrefixMatch(worker, num_blocks, {str(t): n for t, n in per_tier.items()})
        return out

    def num_blocks(self, worker: WorkerId) -> int:
        return len(self._by_worker.get(worker, ()))

    def next_seq(self, worker: WorkerId) -> int | None:
        stream = self._streams.get(worker)
        return None if stream is None else stream.next_seq

    def purge_epoch(self) -> int:
        return self._purge_epoch

    def advance_purge_epoch(self) -> int:
        self._purge_epoch += 1
        return self._purge_epoch

    def workers(self) -> list[WorkerId]:
        """Workers with a live event stream, in sorted order."""
        return sorted(self._streams)

    def check_integrity(self) -> None:
        """Raise AssertionError if the two maps disagree or hold empty entries."""
        for block_hash, holders in self._by_hash.items():
            assert holders, "a hash with no holder is kept"
            for worker, tiers in holders.items():
                assert tiers, "a worker entry with no tier is kept"
                assert block_hash in self._by_worker.get(worker, set()), "worker set is missing"
        for block_hash, holders in self._by_hash.items():
            fastest = {w: min(tiers, key=_tier_rank) for w, tiers in holders.items()}
            assert self._fastest.get(block_hash) == fastest, "fastest tiers are stale"
        assert self._fastest.keys() == self._by_hash.keys(), "fastest tiers of a dropped hash"
        for worker, owned in self._by_worker.items():
            for block_hash in owned:
                assert worker in self._by_hash.get(block_hash, {}), "hash map is missing"
