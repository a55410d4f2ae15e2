"""Writes blocks worth sharing to the shared tier (Redis), once each.

A block is worth sharing once it was reused `min_reuse` times. The shared tier is only ever asked,
never managed: other workers write it and Redis evicts by itself, so all that is kept here is how
often each block was reused and which blocks were sent already (not to send them twice). Both
tables are bounded, least recently counted or sent forgotten first.

Every write is a Stored event of the shared tier in the worker's `EventLog`, every write it lost a
Removed one. State lives on the owner's thread (the `TierManager`'s).

Lossy KV is shared only under a quantized codec: other workers and deployments read the shared
tier, and a lossless blob would be exact KV to them. The sent table is forgotten only when the
shared tier says it lost everything (`TierStats.restarts`: a restarted Redis), not on a failed
call: a read that timed out says nothing of what the server holds, and forgetting would make
the worker send every popular block again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cachesvc.kv.codec import Codec
from cachesvc.kv.events import EventLog
from cachesvc.kv.tiers.base import Tier
from cachesvc.kv.tiers.payload import Payload
from cachesvc.kv.tiers.results import ManagerStats
from cachesvc.kv.types import BlockHash

_MAX_TRACKED = 1 << 20  # reuse counters and sent blocks kept


class Sharing:
    """Reuse counts of blocks, and the writes of the popular ones to `shared` (each counted in
    `stats.shared`, the manager's counters)."""

    def __init__(
        self,
        shared: Tier,
        codec: Codec,
        events: EventLog,
        stats: ManagerStats,
        min_reuse: int,
    ) -> None:
        self.shared = shared
        self.codec = codec
        self.events = events
        self.stats = stats
        self.min_reuse = min_reuse
        self._reuse: OrderedDict[BlockHash, int] = OrderedDict()
        self._sent: OrderedDict[BlockHash, None] = OrderedDict()
        self._restarts = 0  # the shared tier's restart count when last polled

    def note_reuse(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Count one reuse of each block; returns those that just became worth sharing."""
        ready: list[BlockHash] = []
        for h in hashes:
            count = self._reuse.pop(h, 0) + 1
            self._reuse[h] = count
            if count >= self.min_reuse and h not in self._sent:
                ready.append(h)
        while len(self._reuse) > _MAX_TRACKED:
            self._reuse.popitem(last=False)
        return ready

    def offer(self, payload: Payload) -> bool:
        """Share a block leaving a tier if it was reused enough (see `share`)."""
        return self._reuse.get(payload.block_hash, 0) >= self.min_reuse and self.share(payload)

    def share(self, payload: Payload) -> bool:
        """Write a block (once), however often it was reused; False when it was sent already,
        is lossy and the codec lossless (counted), fails verification or the shared tier
        refused it."""
        h = payload.block_hash
        if h in self._sent:
            return False
        if payload.lossy and self.codec.lossless:
            self.stats.lossy_refused += 1
            return False
        data = payload.encoded(self.codec)
        if data is None or not self.shared.put([payload.item(data)]):
            return False
        self._sent[h] = None
        while len(self._sent) > _MAX_TRACKED:
            self._sent.popitem(last=False)
        self.stats.shared += 1
        self.events.stored(self.shared.name, (h,), payload.parent)
        return True

    def poll(self) -> None:
        """Account for writes the shared tier lost in the background, and forget what was sent
        once the shared tier lost everything (a restarted Redis kept nothing)."""
        lost = self.shared.drain_lost()
        for h in lost:
            self._sent.pop(h, None)
        if lost:
            self.events.removed(self.shared.name, tuple(lost))
        if self.shared.stats.restarts != self._restarts:
            self._restarts = self.shared.stats.restarts
            self._sent.clear()

    def forget_sent(self) -> None:
        """The shared tier was cleared: every block is worth sending again."""
        self._sent.clear()
