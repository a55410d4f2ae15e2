"""The holder's ring of same-node staging slots (`workers.transfer.slots` says what a slot is).

Slots are made on need, up to `max_slots`, one after the other on a thread of their own (one per
chunk that found none free), and kept: a fresh segment's pages are faulted in once, when it is
made (first-touch page faults cost more than the copy itself: 3-7 ms per MiB on this VM), never
on a pull's path; a chunk that finds no free slot goes through the object store meanwhile. A
slot is free when its last lease was released by its puller, or when that puller's process is
gone (a killed puller leaks nothing for longer than the next look). A live puller's lease is
never taken back, however old: the puller may land the rows at any later step, and overwriting
them would land wrong KV. With every slot leased, `take` says so and the holder sends through
the object store instead.

Thread-safe: the exporter takes and leases slots on its loop and threads, its load report
counts them.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field

import numpy as np

from workers.transfer.slots import (
    DATA_OFFSET,
    LEASED,
    PULLER_PID,
    PULLER_START,
    RELEASED,
    SEGMENT,
    PullerProcess,
    SlotRef,
    alive,
    header,
)
from workers.transfer.threads import lower_priority


@dataclass(eq=False)
class Slot:
    """One segment of the ring: its fd (which the puller opens through /proc), its mapping and
    the data part of it, where a chunk is staged."""

    fd: int
    segment_id: int
    mapping: mmap.mmap
    data: memoryview  # the payload's room, after the header page
    header: np.ndarray
    taken: bool = field(default=False)  # staged into by the holder, not yet leased or given back


class SlotRing:
    """At most `max_slots` slots of `slot_bytes` each."""

    def __init__(self, slot_bytes: int, max_slots: int) -> None:
        assert slot_bytes > 0 and max_slots > 0
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self._slots: list[Slot] = []
        self._due = 0  # slots to be made, by one thread at a time
        self._lock = threading.Lock()
        self.num_reclaimed = 0  # leases taken back from pullers that died

    def take(self) -> Slot | None:
        """A free slot to stage a chunk into, or None. Never blocks: each time none is free
        and the ring has room, one more slot is due, made on a thread of its own (its pages
        written there, not on a pull's path) for a later chunk."""
        with self._lock:
            seen: dict[tuple[int, int], bool] = {}
            for slot in self._slots:
                if not slot.taken and self._free(slot, seen):
                    slot.taken = True
                    return slot
            if len(self._slots) + self._due >= self.max_slots:
                return None
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

    def _grow(self) -> None:
        """Make the slots that are due, one after the other (a pull that found none free
        wants as many as it missed)."""
        lower_priority()  # writing a slot's pages is no step's business
        while True:
            try:
                slot: Slot | None = _make_slot(self.slot_bytes)
            except OSError:  # out of memory for it: the object store it is
                slot = None
            with self._lock:
                if slot is None:
                    self._due = 0
                    return
                self._slots.append(slot)
                self._due -= 1
                if not self._due:
                    return

    def lease(self, slot: Slot, puller: PullerProcess, array: np.ndarray) -> SlotRef:
        """Lease a taken slot, whose data `array` (a view of `slot.data`) now holds, to
        `puller`: the slot stays the puller's until it releases it or dies."""
        assert slot.taken and array.nbytes <= len(slot.data)
        h = slot.header
        generation = int(h[LEASED]) + 1
        h[PULLER_PID], h[PULLER_START] = puller.pid, puller.start_time
        h[LEASED] = generation  # last: the lease is whole once this word is
        with self._lock:
            slot.taken = False
        return SlotRef(
            os.getpid(),
            slot.fd,
            slot.segment_id,
            generation,
            DATA_OFFSET,
            array.nbytes,
            tuple(array.shape),
            array.dtype.str,
        )

    def give_back(self, slot: Slot) -> None:
        """A taken slot that was not leased after all (the export failed or was cancelled)."""
        with self._lock:
            slot.taken = False

    def revoke(self, slot: Slot) -> None:
        """End the slot's lease from the holder's side: its reply never reached the puller (the
        export was cancelled after the lease), so nobody will release it."""
        slot.header[RELEASED] = slot.header[LEASED]

    def num_slots(self) -> int:
        with self._lock:
            return len(self._slots)

    def num_leased(self) -> int:
        """Slots leased to a live puller now (those of dead pullers are taken back here)."""
        seen: dict[tuple[int, int], bool] = {}  # a puller's liveness, read once per call
        with self._lock:
            return sum(1 for s in self._slots if not s.taken and not self._free(s, seen))

    def close(self) -> None:
        """Close the segments' fds: a puller's mapping keeps its segment until it lets go; the
        holder's own mappings go with their last view."""
        with self._lock:
            for slot in self._slots:
                os.close(slot.fd)
            self._slots.clear()

    def _free(self, slot: Slot, seen: dict[tuple[int, int], bool]) -> bool:
        """Whether the slot's last lease ended (under the lock); `seen` keeps the pullers'
        liveness for the caller's pass over the slots (a file read each)."""
        h = slot.header
        if h[RELEASED] == h[LEASED]:
            return True
        puller = (int(h[PULLER_PID]), int(h[PULLER_START]))
        if puller not in seen:
            seen[puller] = alive(*puller)
        if seen[puller]:
            return False
        h[RELEASED] = h[LEASED]  # its puller is gone: nobody reads it any more
        self.num_reclaimed += 1
        return True


def _make_slot(slot_bytes: int) -> Slot:
    """A fresh segment with its pages allocated and mapped in (no fault on the pull's path)."""
    size = DATA_OFFSET + slot_bytes
    fd = os.memfd_create("cachesvc-kv-slot", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(mapping)
    h = header(view[:DATA_OFFSET])
    segment_id = secrets.randbits(63)
    h[SEGMENT] = segment_id
    return Slot(fd, segment_id, mapping, view[DATA_OFFSET:], h)
