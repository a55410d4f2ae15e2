"""The holder's ring of same-node staging slots (`workers.transfer.slots` says what a slot is).

Slots are made on need, up to `max_slots`, one after the other on a thread of their own (one per
chunk that found none free), and kept: a fresh segment's pages are faulted in once, when it is
made (first-touch page faults cost more than the copy itself: 3-7 ms per MiB on this VM), never
on a pull's path; a chunk that finds no free slot goes through the object store meanwhile.

A slot's life: free (its rows all zero) → taken (the holder stages a chunk into it) → leased to
the one pull that asked (`lease`: a fresh capability) → its lease ends → scrubbed (its rows
zeroed, on a thread of the ring's: no tenant's KV stays in a segment other processes may map)
→ free. A lease ends when its pull releases it naming the capability (`release`, the puller's
message), when the holder's reply never went out (`revoke`), or when the process the puller
named is gone (looked at when the ring looks for a free slot). The holder never ends a live
puller's lease, however old: the puller may land the rows at any later step, and overwriting
them would land wrong KV. The puller's process is only the caller's word, though, so a lease
older than `lease_ttl_s` retires its slot instead of freeing it: the ring closes the segment and
never writes it again (whoever still maps it keeps its rows as they were) and makes another
when it needs one. With every slot leased, `take` says so and the holder sends through the
object store instead.

Thread-safe: the exporter takes and leases slots on its loop and threads, its load report
counts them, releases come on its loop.
"""

from __future__ import annotations

import enum
import hmac
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from workers.transfer.segment import make_segment
from workers.transfer.slots import (
    CAPABILITY_BYTES,
    DATA_OFFSET,
    LEASE_TAG,
    LEASED,
    SEGMENT,
    PullerProcess,
    SlotLease,
    SlotRef,
    alive,
    header,
    lease_tag,
)
from workers.transfer.threads import lower_priority

# How long a lease may keep its slot. A pull lands its chunks by its deadline and one step after
# (seconds): a lease this old belongs to a puller that is stuck, or to a process that named
# another's pid, and its slot is retired, not reused (nothing it holds is overwritten).
LEASE_TTL_S = 300.0
_log = logging.getLogger(__name__)


class SlotState(enum.Enum):
    FREE = "free"  # zeroed: may be taken
    TAKEN = "taken"  # being staged into by the holder, not leased yet
    LEASED = "leased"
    DIRTY = "dirty"  # its last use ended: zeroed on the ring's thread, then free
    RETIRED = "retired"  # closed with a lease past its time: never written again


@dataclass(frozen=True)
class _Lease:
    capability: bytes = field(repr=False)
    puller: PullerProcess  # the caller's word: only ever used to end the lease early
    since: float  # time.monotonic()
    nbytes: int  # of the slot's data the leased chunk covers


@dataclass(eq=False)
class Slot:
    """One segment of the ring: its fd (which the puller opens through /proc), the holder's
    mapping and the data part of it, where a chunk is staged; its state and lease, which live
    here and never in the segment."""

    fd: int
    segment_id: int
    mapping: mmap.mmap
    data: memoryview  # the payload's room, after the header page
    header: np.ndarray
    state: SlotState = SlotState.FREE
    generation: int = 0  # of its last lease
    lease: _Lease | None = None
    dirty_bytes: int = 0  # of `data` its last use may have written: zeroed before it is free


class SlotRing:
    """At most `max_slots` slots of `slot_bytes` each; a lease older than `lease_ttl_s`
    retires its slot."""

    def __init__(self, slot_bytes: int, max_slots: int, lease_ttl_s: float = LEASE_TTL_S) -> None:
        assert slot_bytes > 0 and max_slots > 0
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self.lease_ttl_s = lease_ttl_s
        self._slots: list[Slot] = []
        self._due = 0  # slots to be made, by one thread at a time
        self._dirty: list[Slot] = []  # to be zeroed, by one thread at a time
        self._scrubbing = False
        self._lock = threading.Lock()
        self.num_reclaimed = 0  # leases taken back from pullers that died
        self.num_retired = 0  # slots closed for a lease past `lease_ttl_s`
        self._warned = False

    def take(self) -> Slot | None:
        """A free slot to stage a chunk into, or None. Never blocks: each time none is free,
        none is being scrubbed and the ring has room, one more slot is due, made on a thread of
        its own (its pages written there, not on a pull's path) for a later chunk."""
        with self._lock:
            self._look()
            for slot in self._slots:
                if slot.state is SlotState.FREE:
                    slot.state = SlotState.TAKEN
                    return slot
            if self._dirty or len(self._slots) + self._due >= self.max_slots:
                return None  # one is free in a moment, or the ring may not grow
            self._due += 1
            if self._due > 1:  # the thread making them is on its way
                return None
        threading.Thread(target=self._grow, name="kv-slot-grow", daemon=True).start()
        return None

    def prepare(self, num_slots: int) -> None:
        """Have at least `num_slots` slots (at most the ring's), made on a thread of their own
        now, before a pull asks: for a pull known to come (a hand-off's prefill)."""
        with self._lock:
            want = min(num_slots, self.max_slots) - len(self._slots) - self._due
            if want <= 0:
                return
            idle = self._due == 0
            self._due += want
        if idle:
            threading.Thread(target=self._grow, name="kv-slot-grow", daemon=True).start()

    def lease(self, slot: Slot, puller: PullerProcess, array: np.ndarray) -> SlotRef:
        """Lease a taken slot, whose data `array` (a view of the start of `slot.data`) now
        holds, to the pull that asked, `puller` its process: the slot stays leased until the
        pull releases it naming the capability in the returned reference (its reply's, and no
        one else's), the holder revokes it, or that process is gone."""
        assert array.nbytes <= len(slot.data)
        capability = secrets.token_bytes(CAPABILITY_BYTES)
        with self._lock:
            assert slot.state is SlotState.TAKEN
            slot.generation += 1
            slot.lease = _Lease(capability, puller, time.monotonic(), array.nbytes)
            slot.state = SlotState.LEASED
            # For the puller's check of its reference, before the reply leaves.
            slot.header[LEASE_TAG] = lease_tag(capability)
            slot.header[LEASED] = slot.generation
        return SlotRef(
            os.getpid(),
            slot.fd,
            slot.segment_id,
            slot.generation,
            capability,
            DATA_OFFSET,
            array.nbytes,
            tuple(array.shape),
            array.dtype.str,
        )

    def release(self, lease: SlotLease) -> bool:
        """End a lease at its pull's word: whether `lease` names a slot's current lease and the
        capability it was issued with (a release of another pull's lease, a guessed or an old
        one ends nothing). Never raises on a malformed lease (it comes off the wire)."""
        if not isinstance(lease, SlotLease) or not isinstance(lease.capability, bytes):
            return False
        with self._lock:
            for slot in self._slots:
                if slot.segment_id == lease.segment_id and _issued(slot, lease.capability):
                    self._end(slot)
                    return True
        return False

    def revoke(self, slot: Slot, ref: SlotRef) -> None:
        """End the lease `ref` names from the holder's side: its reply never reached the puller
        (the export was cancelled after the lease), so nobody will release it."""
        with self._lock:
            if _issued(slot, ref.capability):
                self._end(slot)

    def give_back(self, slot: Slot, written: int | None) -> None:
        """A taken slot that was not leased after all (nothing to send, or the export failed or
        was cancelled): free again once the `written` bytes of its data (None: unknown, all of
        them) are zeroed."""
        with self._lock:
            assert slot.state is SlotState.TAKEN
            slot.dirty_bytes = len(slot.data) if written is None else written
            self._end(slot)

    def num_slots(self) -> int:
        with self._lock:
            return len(self._slots)

    def num_leased(self) -> int:
        """Slots leased to a live puller now (those of dead pullers are taken back here)."""
        with self._lock:
            self._look()
            return sum(1 for s in self._slots if s.state is SlotState.LEASED)

    def close(self) -> None:
        """Close the segments' fds: a puller's mapping keeps its segment until it lets go; the
        holder's own mappings go with their last view."""
        with self._lock:
            for slot in self._slots:
                os.close(slot.fd)
            self._slots.clear()

    def _look(self) -> None:
        """End the leases of pullers that are gone, retire the slots of leases past their time
        (under the lock). A puller's liveness is read once per look (a file read each)."""
        seen: dict[PullerProcess, bool] = {}
        now = time.monotonic()
        for slot in [s for s in self._slots if s.lease is not None]:
            lease = slot.lease
            assert lease is not None
            if lease.puller not in seen:
                seen[lease.puller] = alive(lease.puller.pid, lease.puller.start_time)
            if not seen[lease.puller]:
                self._end(slot)  # its puller is gone: nobody reads it any more
                self.num_reclaimed += 1
            elif now - lease.since > self.lease_ttl_s:
                self._slots.remove(slot)
                os.close(slot.fd)  # no process opens it through this holder from now on
                slot.state, slot.lease = SlotState.RETIRED, None
                self.num_retired += 1

    def _end(self, slot: Slot) -> None:
        """The slot's use ended: refuse its lease to readers, zero what it held (on the ring's
        thread), then it is free (under the lock)."""
        if slot.lease is not None:
            slot.dirty_bytes = max(slot.dirty_bytes, slot.lease.nbytes)
        slot.lease = None
        slot.header[LEASE_TAG] = slot.header[LEASED] = 0
        if not slot.dirty_bytes:
            slot.state = SlotState.FREE
            return
        slot.state = SlotState.DIRTY
        self._dirty.append(slot)
        if not self._scrubbing:
            self._scrubbing = True
            threading.Thread(target=self._scrub, name="kv-slot-scrub", daemon=True).start()

    def _scrub(self) -> None:
        """Zero the rows of the slots whose use ended, one after the other, and free them."""
        lower_priority()  # zeroing a slot is no step's business
        while True:
            with self._lock:
                if not self._dirty:
                    self._scrubbing = False
                    return
                slot = self._dirty.pop()
                nbytes = slot.dirty_bytes
            np.frombuffer(slot.data, dtype=np.uint8, count=nbytes).fill(0)
            with self._lock:
                slot.dirty_bytes = 0
                slot.state = SlotState.FREE

    def _grow(self) -> None:
        """Make the slots that are due, one after the other (a pull that found none free
        wants as many as it missed)."""
        lower_priority()  # writing a slot's pages is no step's business
        while True:
            try:
                slot: Slot | None = _make_slot(self.slot_bytes)
            except OSError as exc:  # out of memory for it, or no seals: the object store it is
                if not self._warned:
                    self._warned = True
                    _log.warning("cannot make a same-node KV slot (%s): object store used", exc)
                slot = None
            with self._lock:
                if slot is None:
                    self._due = 0
                    return
                self._slots.append(slot)
                self._due -= 1
                if not self._due:
                    return


def _issued(slot: Slot, capability: bytes) -> bool:
    """Whether `capability` is the one the slot's current lease was issued with."""
    return slot.lease is not None and hmac.compare_digest(slot.lease.capability, capability)


def _make_slot(slot_bytes: int) -> Slot:
    """A fresh sealed segment, its pages allocated and mapped in (no fault on the pull's path)."""
    fd, mapping = make_segment(DATA_OFFSET + slot_bytes)
    view = memoryview(mapping)
    h = header(view[:DATA_OFFSET])
    segment_id = secrets.randbits(63)
    h[SEGMENT] = segment_id
    return Slot(fd, segment_id, mapping, view[DATA_OFFSET:], h)
