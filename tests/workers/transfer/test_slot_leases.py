"""Same-node slots hold against the other processes of the node: a segment cannot be shrunk,
grown or written by another process (its holder keeps gathering into it), a puller's descriptor
and mapping are read-only, a lease is ended only by the capability issued with it (never by
another pull, nor by a store into the segment), a released slot's rows are zeroed before it is
leased again, and a lease held past its time retires its slot without touching its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import xxhash
from slot_support import (
    HOLDER,
    NODE,
    Puller,
    collecting_reader,
    leased,
    make_stager,
    rows,
    wait_for_slot,
)

from workers.transfer.segment import UnsealedSegment, map_readonly
from workers.transfer.slot_reader import StaleSlot
from workers.transfer.slots import DATA_OFFSET, LEASE_TAG, LEASED, SlotLease, this_process

# Another process of the same uid, at a holder's segment through /proc: every way it could
# change the segment's size or bytes, and what came of each.
TAMPER = """
import json, mmap, os, sys
path, size = f"/proc/{sys.argv[1]}/fd/{sys.argv[2]}", int(sys.argv[3])
outcome = {}
try:
    fd = os.open(path, os.O_RDWR)
except PermissionError:  # not root: the segment's mode refuses it for writing already
    outcome["open for writing"] = "refused"
    fd = os.open(path, os.O_RDONLY)
attempts = {
    "shrink": lambda: os.ftruncate(fd, 0),
    "grow": lambda: os.ftruncate(fd, 2 * size),
    "extend": lambda: os.posix_fallocate(fd, 0, 2 * size),
    "write": lambda: os.pwrite(fd, b"x" * 8, 4096),
    "map writable": lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED),
}
for name, attempt in attempts.items():
    try:
        attempt()
        outcome[name] = "done"
    except OSError as exc:
        outcome[name] = f"refused ({exc.strerror})"
print(json.dumps(outcome))
"""


@pytest.fixture
def puller() -> Iterator[Puller]:
    p = Puller()
    yield p
    p.close()


def _checksum(array: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array).tobytes())


def test_another_process_cannot_resize_or_write_a_slot() -> None:
    """The attack that killed a holder (SIGBUS at its next gather into a truncated slot) is
    refused by the kernel; the holder gathers into the slot and a puller reads it as before."""
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    stager.ring.give_back(wait_for_slot(stager.ring), 0)
    staging = stager.take(me, 3)
    assert staging.slot is not None
    size = os.fstat(staging.slot.fd).st_size
    args = [str(os.getpid()), str(staging.slot.fd), str(size)]
    tampered = subprocess.run(
        [sys.executable, "-c", TAMPER, *args], capture_output=True, text=True, check=True
    )
    outcome = json.loads(tampered.stdout)
    assert all(result.startswith("refused") for result in outcome.values()), outcome
    assert os.fstat(staging.slot.fd).st_size == size
    payload = rows(10)
    staging.buffer[:3] = staging.buffer.new_tensor(payload)  # the holder's gather, unharmed
    staged = staging.buffer[:3].numpy()
    np.testing.assert_array_equal(staged, payload)
    ref = stager.ring.lease(staging.slot, me, staged)
    np.testing.assert_array_equal(collecting_reader([]).open(ref, HOLDER), payload)


def test_a_puller_reads_read_only_and_only_sealed_segments(puller: Puller) -> None:
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)
    payload = rows(11)
    _, ref = leased(stager, me, payload)
    view = collecting_reader([]).open(ref, HOLDER)
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 0
    assert puller.open(ref) == _checksum(payload)  # another process reads it the same
    # A segment that could shrink under the puller's mapping is never mapped.
    plain = os.memfd_create("not-a-slot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(plain, DATA_OFFSET + payload.nbytes)
        forged = replace(ref, fd=plain)
        with pytest.raises(UnsealedSegment):
            collecting_reader([]).open(forged, HOLDER)
    finally:
        os.close(plain)


def test_only_the_capability_issued_with_a_lease_ends_it(puller: Puller) -> None:
    """A release by another pull (its own capability), a guessed one, one aimed at another slot,
    or a store into the segment ends nothing: the slot's rows stay the puller's."""
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=8)  # two slots
    assert stager.ring is not None
    payload = rows(12)
    slot, mine = leased(stager, puller.process, payload)
    _, theirs = leased(stager, me, rows(13))
    assert puller.open(mine) == _checksum(payload)
    for lease in (
        SlotLease(mine.segment_id, theirs.capability),  # another pull's capability
        SlotLease(mine.segment_id, os.urandom(16)),  # a guess
        SlotLease(theirs.segment_id, mine.capability),  # the right one, at another slot
        SlotLease(mine.segment_id, mine.capability.hex().encode()),  # malformed
    ):
        assert stager.release([lease]) == 0
    # What ended a lease before: the puller's store of its generation into the header.
    slot.header[LEASED] = slot.header[LEASE_TAG] = 0
    assert stager.ring.num_leased() == 2
    assert stager.ring.take() is None  # nothing free: nobody overwrites the puller's rows
    assert stager.release([theirs.lease]) == 1
    assert stager.release([mine.lease]) == 1
    assert stager.release([mine.lease]) == 0  # once only
    assert stager.ring.num_leased() == 0


def test_a_reference_with_another_capability_is_refused(puller: Puller) -> None:
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)
    _, ref = leased(stager, me, rows(14))
    forged = replace(ref, capability=os.urandom(16))
    with pytest.raises(StaleSlot):
        collecting_reader([]).open(forged, HOLDER)
    assert puller.open(forged).startswith("refused StaleSlot")


def test_a_released_slot_holds_no_stale_rows(puller: Puller) -> None:
    """Once a lease ends, its rows are zeroed before the slot is free: a process mapping the
    segment meanwhile, or the next lease's puller, never sees them."""
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    first = rows(15, num=3)
    slot, ref = leased(stager, puller.process, first)
    assert puller.open(ref) == _checksum(first)
    assert stager.release(puller.drop()) == 1
    assert wait_for_slot(stager.ring) is slot
    snooped = np.frombuffer(map_readonly(os.getpid(), slot.fd), dtype=np.uint8)
    assert not snooped[DATA_OFFSET:].any()  # all zero, header aside
    second = rows(16, num=1)  # a shorter chunk: the first's tail would show past it
    data = np.frombuffer(slot.data, dtype=np.float32, count=second.size).reshape(second.shape)
    data[:] = second
    ref = stager.ring.lease(slot, puller.process, data)
    assert puller.open(ref) == _checksum(second)
    assert not snooped[DATA_OFFSET + second.nbytes :].any()


def test_a_lease_past_its_time_retires_its_slot(puller: Puller) -> None:
    """A lease whose puller lives on (or whose named pid is another process's) does not pin a
    slot for good: past its time the slot is retired, and what its puller reads stays as it
    was while the ring makes and fills another."""
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    stager.ring.lease_ttl_s = 0.0
    payload = rows(17)
    slot, ref = leased(stager, puller.process, payload)
    view = collecting_reader([]).open(ref, HOLDER)
    assert stager.ring.take() is None  # retires it (and asks for another)
    assert stager.ring.num_retired == 1 and stager.ring.num_leased() == 0
    fresh = wait_for_slot(stager.ring)
    assert fresh is not slot
    np.frombuffer(fresh.data, dtype=np.uint8)[:] = 0xFF
    np.testing.assert_array_equal(view, payload)
    assert stager.release([ref.lease]) == 0  # nothing left to end
