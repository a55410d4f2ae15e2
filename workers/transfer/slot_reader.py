"""The puller's side of same-node slots: map a holder's segment, read a chunk in place, and
release its lease when nothing holds a view of it any more (`workers.transfer.slots`).

The payload handed out is a numpy view of the holder's segment: the digest check reads it and
the landing copies it into the puller's KV cache, the only copies on this side. The lease ends
with the last view of the payload, whichever thread drops it (the engine's, once it landed the
blocks at a later step; a pull thread, for a chunk that did not verify): a `weakref.finalize`
writes the release into the segment's header, a store to shared memory, no call to the holder.

Mappings are kept per segment (a segment is mapped, and its pages are in this process's page
tables, once) and dropped once their holder's process is gone. Thread-safe.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from workers.transfer.slots import (
    DATA_OFFSET,
    LEASED,
    RELEASED,
    SEGMENT,
    SlotRef,
    header,
    start_time,
)


class StaleSlot(ValueError):
    """The slot a reply names is not (or no longer) leased as the reply says."""


@dataclass(frozen=True)
class _Mapped:
    view: memoryview
    header: np.ndarray


class SlotReader:
    """Maps same-node holders' slots for one puller process."""

    def __init__(self) -> None:
        self._mapped: dict[tuple[int, int, int], _Mapped] = {}
        self._lock = threading.Lock()
        self.num_released = 0  # leases this process ended (views gone, or replies unread)

    def open(self, ref: SlotRef) -> np.ndarray:
        """The payload `ref` names, read in place; its lease is released when the last view of
        it is gone. Raises OSError when the segment cannot be mapped (the holder is gone, or
        this process may not open its fds) and `StaleSlot` when the lease is not `ref`'s."""
        mapped = self._map(ref)
        if int(mapped.header[LEASED]) != ref.generation:
            raise StaleSlot(f"slot {ref.segment_id} is not leased as generation {ref.generation}")
        end = ref.offset + ref.nbytes
        if ref.offset < DATA_OFFSET or end > len(mapped.view):
            raise StaleSlot(f"slot {ref.segment_id} has no bytes {ref.offset}..{end}")
        flat = np.frombuffer(mapped.view[ref.offset : end], dtype=np.dtype(ref.dtype))
        # Every view of the payload (its reshape, its rows, a tensor over them) keeps `flat`
        # alive: once it goes, nothing here reads the slot and the holder may reuse it.
        weakref.finalize(flat, self._release, mapped.header, ref.generation)
        return flat.reshape(ref.shape)

    def release(self, ref: SlotRef) -> None:
        """End the lease of a reply that was never opened (its pull was cancelled or failed
        before it was read). Never raises: a holder that is gone has nothing to release."""
        try:
            mapped = self._map(ref)
        except (OSError, StaleSlot):
            return
        self._release(mapped.header, ref.generation)

    def _release(self, h: np.ndarray, generation: int) -> None:
        if int(h[LEASED]) == generation:  # else the holder took it back: not ours to end
            h[RELEASED] = generation
            self.num_released += 1

    def _map(self, ref: SlotRef) -> _Mapped:
        key = (ref.holder_pid, ref.fd, ref.segment_id)
        with self._lock:
            mapped = self._mapped.get(key)
        if mapped is not None:
            return mapped
        mapped = _map_segment(ref)
        with self._lock:
            self._forget_gone()
            return self._mapped.setdefault(key, mapped)

    def _forget_gone(self) -> None:
        """Drop the mappings of holders that are gone (under the lock); a view still in use
        keeps its own segment mapped until it goes."""
        for key in [k for k in self._mapped if start_time(k[0]) is None]:
            del self._mapped[key]


def _map_segment(ref: SlotRef) -> _Mapped:
    """Map the holder's segment, its pages into this process's page tables at once."""
    fd = os.open(f"/proc/{ref.holder_pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    view = memoryview(mapping)
    h = header(view[:DATA_OFFSET])
    if int(h[SEGMENT]) != ref.segment_id:  # the fd was closed and reused: not our segment
        raise StaleSlot(f"fd {ref.fd} of process {ref.holder_pid} is another segment")
    return _Mapped(view, h)
