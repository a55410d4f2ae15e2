"""The puller's side of same-node slots: map a holder's segment read-only, read a chunk in place,
and release its lease by a message to the holder when nothing holds a view of it any more
(`workers.transfer.slots`).

The payload handed out is a read-only numpy view of the holder's segment: the digest check reads
it and the landing copies it into the puller's KV cache, the only copies on this side. The lease
ends with the last view of the payload, whichever thread drops it (the engine's, once it landed
the blocks at a later step; a pull thread, for a chunk that did not verify): a
`weakref.finalize` hands the lease to `send`, which carries it to the holder (the link's
message, `ray_link`). This process never writes a segment: its descriptor and its mapping are
read-only, and the holder keeps its leases in its own memory.

Mappings are kept per segment (a segment is mapped, and its pages are in this process's page
tables, once) and dropped once their holder's process is gone or its fd names another segment.
Thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workers.transfer.segment import map_readonly
from workers.transfer.slots import (
    DATA_OFFSET,
    LEASE_TAG,
    LEASED,
    SEGMENT,
    SlotLease,
    SlotRef,
    header,
    lease_tag,
    start_time,
)

# Carries a lease's release to the holder named by the first argument (the puller's name of
# it). Called from a finalizer, in any thread, inside a garbage collection: it must not block
# nor take a lock another thread may hold (`queue.SimpleQueue.put` is made for this).
SendRelease = Callable[[str, SlotLease], object]


class StaleSlot(ValueError):
    """The slot a reply names is not (or no longer) leased as the reply says."""


@dataclass(frozen=True)
class _Mapped:
    view: memoryview  # of the whole segment: it keeps the mapping
    header: np.ndarray


class SlotReader:
    """Maps same-node holders' slots for one puller process; `send` carries releases."""

    def __init__(self, send: SendRelease) -> None:
        self._send = send
        self._mapped: dict[tuple[int, int, int], _Mapped] = {}
        self._lock = threading.Lock()
        self.num_released = 0  # leases this process ended (views gone, or replies unread)

    def open(self, ref: SlotRef, holder: str) -> np.ndarray:
        """The payload `ref` names, read in place (read-only), from the slot of `holder`; its
        lease is released when the last view of it is gone. Raises OSError when the segment
        cannot be mapped (the holder is gone, or this process may not open its fds, or it is not
        sealed) and `StaleSlot` when the slot is not leased as `ref` says, capability included.
        Either way the lease is the caller's to `release`."""
        mapped = self._map(ref)
        h = mapped.header
        if int(h[LEASED]) != ref.generation or int(h[LEASE_TAG]) != lease_tag(ref.capability):
            raise StaleSlot(f"slot {ref.segment_id} is not leased as generation {ref.generation}")
        end = ref.offset + ref.nbytes
        if ref.offset < DATA_OFFSET or end > len(mapped.view):
            raise StaleSlot(f"slot {ref.segment_id} has no bytes {ref.offset}..{end}")
        flat = np.frombuffer(mapped.view[ref.offset : end], dtype=np.dtype(ref.dtype))
        # Every view of the payload (its reshape, its rows, a tensor over them) keeps `flat`
        # alive: once it goes, nothing here reads the slot and the holder may reuse it.
        weakref.finalize(flat, self._release, holder, ref.lease)
        return flat.reshape(ref.shape)

    def release(self, ref: SlotRef, holder: str) -> None:
        """End the lease of a reply that was never opened, or did not open (its pull was
        cancelled or failed before it was read). Never raises, never blocks."""
        self._release(holder, ref.lease)

    def _release(self, holder: str, lease: SlotLease) -> None:
        self._send(holder, lease)
        self.num_released += 1

    def _map(self, ref: SlotRef) -> _Mapped:
        key = (ref.holder_pid, ref.fd, ref.segment_id)
        with self._lock:
            mapped = self._mapped.get(key)
        if mapped is not None:
            return mapped
        mapping = map_readonly(ref.holder_pid, ref.fd)
        view = memoryview(mapping)
        mapped = _Mapped(view, header(view[:DATA_OFFSET]))
        if int(mapped.header[SEGMENT]) != ref.segment_id:  # the fd was closed and reused
            raise StaleSlot(f"fd {ref.fd} of process {ref.holder_pid} is another segment")
        with self._lock:
            self._forget(ref)
            return self._mapped.setdefault(key, mapped)

    def _forget(self, ref: SlotRef) -> None:
        """Drop the mappings of holders that are gone, and of segments whose fd now names
        `ref`'s (under the lock); a view still in use keeps its own segment mapped until it
        goes."""
        for key in list(self._mapped):
            pid, fd, segment = key
            if start_time(pid) is None or (pid, fd) == (ref.holder_pid, ref.fd):
                del self._mapped[key]
