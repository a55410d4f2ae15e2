"""Same-node staging slots: what a holder and a puller on one node share instead of a copy.

A slot is a sealed shared-memory segment (`segment`: it never shrinks or grows, and nobody but
its holder writes it) the holder made and keeps for its lifetime: a header page, then room for
one chunk. The holder gathers a chunk straight into a slot (its only copy), leases the slot to
the pull that asked and answers with a `SlotRef` (a few bytes through Ray, not the payload). The
puller maps the segment read-only through `/proc/<holder pid>/fd/<fd>` (no file name in
`/dev/shm` to leak if the holder dies), checks and lands the rows in place, and once it no longer
holds a view of them ends the lease by a message to the holder (`slot_reader`;
`WorkerActor.release_slots`). A lease outlives the pull: the puller may land at its next step.

A lease is the pull's, not a process's: the holder issues an unguessable capability with it
(`SlotRef.capability`, in the pull's reply and nowhere else), and only a release naming it ends
the lease; the holder keeps its leases in its own memory, never in the segment, so nothing
another process stores there ends one. The puller also names its process (`PullerProcess`):
the holder takes a lease back early when that process is gone, and since that is only the
caller's word, no lease pins a slot past `slot_ring.LEASE_TTL_S` either (`slot_ring`).

Header words (little-endian uint64, written by the holder only): the segment's id, the
generation of its current lease and a tag of that lease's capability (a hash: the header is
readable by any process that maps the segment, the capability must not be), both zero between
leases. The puller refuses a reference they do not match (`slot_reader.StaleSlot`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

DATA_OFFSET = 4096  # the payload starts on its own page, after the header
HEADER_WORDS = 8
SEGMENT, LEASED, LEASE_TAG = range(3)
CAPABILITY_BYTES = 16


@dataclass(frozen=True)
class PullerProcess:
    """Who offers to read a holder's slots in place: its Ray node and its process. A holder on
    another node answers through the object store instead."""

    node_id: str
    pid: int
    start_time: int  # the process's start, in clock ticks since boot (`/proc/<pid>/stat`)


@dataclass(frozen=True)
class SlotLease:
    """What ends a lease: the slot's segment and the capability its holder issued with it."""

    segment_id: int
    capability: bytes = field(repr=False)


@dataclass(frozen=True)
class SlotRef:
    """Where a chunk's payload lies: in the segment `fd` of process `holder_pid`, `nbytes` from
    `offset`, as an array of `shape` and numpy `dtype`, under lease `generation`, whose
    `capability` the holder issued to this pull alone."""

    holder_pid: int
    fd: int
    segment_id: int
    generation: int
    capability: bytes = field(repr=False)  # never in a log line
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # numpy's name of the storage dtype ("<f4", "<u2": bfloat16's bits)

    @property
    def lease(self) -> SlotLease:
        return SlotLease(self.segment_id, self.capability)


def lease_tag(capability: bytes) -> int:
    """The header word that says which capability a slot's lease was issued with (never 0)."""
    digest = hashlib.blake2b(capability, digest_size=8, person=b"kv-slot-lease").digest()
    return int.from_bytes(digest, "little") or 1


def header(buffer: memoryview) -> np.ndarray:
    """The header words of a mapped segment (writable only in the holder's mapping)."""
    return np.frombuffer(buffer, dtype="<u8", count=HEADER_WORDS)


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None when it is gone or a zombie.
    Linux only; elsewhere every process reads as gone (no slots are offered there)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # killed, not yet reaped: gone all the same
        return None
    return int(fields[19])


def alive(pid: int, started: int) -> bool:
    """Whether the process `pid` that started at `started` still runs (not a recycled pid)."""
    return start_time(pid) == started


def this_process(node_id: str | None) -> PullerProcess | None:
    """This process as a puller on `node_id`; None outside Ray or where slots cannot be shared
    (no memfd, no /proc)."""
    started = start_time(os.getpid())
    if node_id is None or started is None or not hasattr(os, "memfd_create"):
        return None
    return PullerProcess(node_id, os.getpid(), started)
