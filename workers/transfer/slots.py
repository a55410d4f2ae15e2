"""Same-node staging slots: what a holder and a puller on one node share instead of a copy.

A slot is an anonymous shared-memory segment (`memfd`) the holder made and keeps for its
lifetime: a header page, then room for one chunk. The holder gathers a chunk straight into a
slot (its only copy), leases the slot to the puller that asked and answers with a `SlotRef`
(a few bytes through Ray, not the payload). The puller maps the segment through
`/proc/<holder pid>/fd/<fd>` (no file name in `/dev/shm` to leak if the holder dies), checks and
lands the rows in place, and releases the lease by writing the lease's generation into the
header once it no longer holds a view of them (`slot_reader`). A lease outlives the pull: the
puller may land at its next step. The holder takes a slot back only when its lease was
released or its puller's process is gone (`slot_ring`).

Header words (little-endian uint64): the segment's id, the generation of the last lease, the
generation the puller last released, the puller's pid and its start time (so a recycled pid is
not taken for the puller). One writer per word: the holder writes the lease, the puller the
release; aligned 8-byte stores are whole on the platforms we run on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

DATA_OFFSET = 4096  # the payload starts on its own page, after the header
HEADER_WORDS = 8
SEGMENT, LEASED, RELEASED, PULLER_PID, PULLER_START = range(5)


@dataclass(frozen=True)
class PullerProcess:
    """Who offers to read a holder's slots in place: its Ray node and its process. A holder on
    another node answers through the object store instead."""

    node_id: str
    pid: int
    start_time: int  # the process's start, in clock ticks since boot (`/proc/<pid>/stat`)


@dataclass(frozen=True)
class SlotRef:
    """Where a chunk's payload lies: in the segment `fd` of process `holder_pid`, `nbytes` from
    `offset`, as an array of `shape` and numpy `dtype`, under lease `generation`."""

    holder_pid: int
    fd: int
    segment_id: int
    generation: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # numpy's name of the storage dtype ("<f4", "<u2": bfloat16's bits)


def header(buffer: memoryview) -> np.ndarray:
    """The header words of a mapped segment, as a writable view."""
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
