"""The shared-memory segment under a same-node slot: made sealed by its holder, mapped read-only by
its pullers.

A segment is an anonymous `memfd`. Every process of the holder's uid on the node (every Ray worker
and driver) can reopen it through `/proc/<holder pid>/fd/<fd>` — that is how a puller maps it, and
nothing stops another process from doing the same — so what such a process can do to it is fixed
on the segment itself, by the kernel, before the holder hands out its fd number:

- **Shrink or grow: never.** `F_SEAL_SHRINK | F_SEAL_GROW`: `ftruncate` and `fallocate` past its
  end fail with EPERM for every process, the holder's included. A segment cut short under the
  holder's mapping would kill the holder with SIGBUS at its next gather into it (every stream of
  that worker with it), and a puller at its next read.
- **Write: only through the holder's own mapping.** `F_SEAL_FUTURE_WRITE` (Linux 5.1) refuses
  `write`, a writable mapping and punching holes from then on, for every process, while the
  mapping the holder made before it stays writable. The plain `F_SEAL_WRITE` would forbid the
  holder's own writes. The mode (0400) refuses reopening it for writing to a process of the same
  uid without root, before the seals are even looked at.
- **The seals themselves: fixed.** `F_SEAL_SEAL`.

Why writes must be refused and not merely detected: the holder seals a chunk (its digest) by
reading the rows back from the slot after its gather, so bytes another process wrote there in
between would be signed as the holder's and land at the puller as exact KV. With writes refused,
nothing the holder reads from a slot comes from anyone but itself; the holder reads no lease
state from the segment either (leases are kept in its own memory and end by a message,
`slot_ring`). A kernel without `F_SEAL_FUTURE_WRITE` makes no segment, and its chunks go through
the object store.

What the seals cannot close: reading. Any process that may open the holder's fds can map a
segment read-only, so a slot's rows are zeroed as soon as its lease ends (`slot_ring`): what such
a process sees is only chunks in flight. A process allowed to ptrace the holder could change its
memory anyway, slots or not. And the few microseconds between `memfd_create` and the write seal,
before the holder has told anyone of the segment: a process that opens it for writing in exactly
that window (root, or before the mode is set) keeps a writable description; the seals go on
before the segment's pages are allocated and faulted in, so that window does not grow with a
slot's size.

The puller checks the seals of what it opened before mapping it (`map_readonly`): a segment that
could shrink under its mapping is never read.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

# The kernel's value since Linux 5.1 (Python's fcntl does not name it on every version).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SEALS = SIZE_SEALS | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_MADV_POPULATE_WRITE = 23  # Linux 5.14: page tables filled in, writable, in one call
_NAME = "cachesvc-kv-slot"


class UnsealedSegment(OSError):
    """A puller opened something that is not a segment sealed as a holder seals its slots."""


def make_segment(size: int) -> tuple[int, mmap.mmap]:
    """A fresh sealed segment of `size` bytes (all zero): its fd and the holder's writable mapping,
    its pages allocated and in this process's page tables (no fault on a pull's path). Raises
    OSError when it cannot be made sealed (no memory, or a kernel without the seals)."""
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o400)  # first: from here on no other process of this uid reopens it rw
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)  # the one writable mapping
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        # Someone may have resized it between the `ftruncate` and the seal: not ours to use.
        if os.fstat(fd).st_size != size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) != SEALS:
            raise UnsealedSegment(f"segment {_NAME} changed while it was made")
        os.posix_fallocate(fd, 0, size)  # within its size: allowed under the seals
        _populate(mapping)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


def map_readonly(pid: int, fd: int) -> mmap.mmap:
    """Map process `pid`'s segment `fd` read-only, its pages in this process's page tables at
    once. Raises OSError when it cannot be opened (the holder is gone, or this process may not
    open its fds) and `UnsealedSegment` when it is not sealed against shrinking and writes."""
    opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            seals = fcntl.fcntl(opened, fcntl.F_GET_SEALS)
        except OSError as exc:  # not a memfd at all: the fd number names something else now
            raise UnsealedSegment(f"fd {fd} of process {pid} is no segment") from exc
        if seals & SEALS != SEALS:
            raise UnsealedSegment(f"fd {fd} of process {pid} is not sealed")
        size = os.fstat(opened).st_size
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        return mmap.mmap(opened, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(opened)


def _populate(mapping: mmap.mmap) -> None:
    """Fault the writable mapping's pages in now (`MAP_POPULATE` is for mappings made before the
    write seal, and this one is made before its pages are allocated)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: touch every page
        np.frombuffer(mapping, dtype=np.uint8).fill(0)
