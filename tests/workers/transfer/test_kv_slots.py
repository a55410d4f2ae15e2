"""Same-node slots between real processes: a holder's slot is read in place by another process,
stays the puller's while it holds a view of it, is free again once the view is gone, and is
taken back when the puller is killed; a full ring, a puller on another node or a chunk bigger
than a slot goes through the object store instead; a stale reference is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import numpy as np
import pytest
import torch
import xxhash

from workers.transfer.chunk import KVChunk
from workers.transfer.slot_reader import SlotReader, StaleSlot
from workers.transfer.slot_ring import Slot, SlotRing
from workers.transfer.slots import PullerProcess, SlotRef, this_process
from workers.transfer.staging import Stager

NODE = "node-a"
BLOCK_SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, heads, head size

# A puller process: says who it is, then on each command opens a reference (and keeps the
# view), drops what it holds, or exits.
PULLER = """
import gc, json, sys
import numpy as np, xxhash
from workers.transfer.slot_reader import SlotReader
from workers.transfer.slots import SlotRef, this_process
reader = SlotReader()
held = []
print(json.dumps(this_process(sys.argv[1]).__dict__), flush=True)
for line in sys.stdin:
    command, _, arg = line.strip().partition(" ")
    if command == "open":
        fields = json.loads(arg)
        ref = SlotRef(**{**fields, "shape": tuple(fields["shape"])})
        held.append(reader.open(ref))
        print(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(held[-1]).tobytes()), flush=True)
    elif command == "drop":
        held.clear()
        gc.collect()
        print(reader.num_released, flush=True)
"""


class Puller:
    """A puller in a process of its own, driven over its stdin."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PULLER, NODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.process = PullerProcess(**json.loads(self._line()))

    def open(self, ref: SlotRef) -> str:
        """The checksum of the payload as the puller reads it in place."""
        return self._ask(f"open {json.dumps(asdict(ref))}")

    def drop(self) -> int:
        """Drop every view it holds; returns how many leases it released so far."""
        return int(self._ask("drop"))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()

    def _ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the puller process died"
        return line.strip()


@pytest.fixture
def puller() -> Iterator[Puller]:
    p = Puller()
    yield p
    p.close()


def _stager(ring_blocks: int, slot_blocks: int = 4) -> Stager:
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    return Stager(BLOCK_SHAPE, torch.float32, 8, slot_blocks, ring_blocks * block_bytes, NODE)


def _wait_for_slot(ring: SlotRing) -> Slot:
    """A slot, once the ring made one on its thread (it makes them off the caller's path)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        slot = ring.take()
        if slot is not None:
            return slot
        time.sleep(0.01)
    raise AssertionError("the ring made no slot")


def _leased(stager: Stager, puller: PullerProcess, rows: np.ndarray) -> tuple[Slot, SlotRef]:
    """A slot holding `rows`, leased to `puller` as an export leases it."""
    assert stager.ring is not None
    slot = _wait_for_slot(stager.ring)
    data = np.frombuffer(slot.data, dtype=rows.dtype, count=rows.size).reshape(rows.shape)
    data[:] = rows
    return slot, stager.ring.lease(slot, puller, data)


def _rows(seed: int, num: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num, *BLOCK_SHAPE)).astype(np.float32)


def test_a_slot_is_read_in_place_and_free_once_its_view_is_gone(puller: Puller) -> None:
    stager = _stager(ring_blocks=4)  # one slot
    assert stager.ring is not None
    rows = _rows(1)
    slot, ref = _leased(stager, puller.process, rows)
    assert puller.open(ref) == xxhash.xxh3_64_hexdigest(rows.tobytes())
    # Held by the puller: the holder neither lists it free nor hands it out again.
    assert stager.ring.num_leased() == 1
    assert stager.ring.take() is None
    assert puller.drop() == 1
    assert stager.ring.num_leased() == 0
    assert stager.ring.take() is slot  # the same slot again, not a new one
    assert stager.ring.num_slots() == 1


def test_a_killed_puller_leaks_no_slot(puller: Puller) -> None:
    stager = _stager(ring_blocks=4)
    assert stager.ring is not None
    slot, ref = _leased(stager, puller.process, _rows(2))
    puller.open(ref)
    assert stager.ring.num_leased() == 1
    puller.kill()  # no release ever comes: the holder sees the process gone
    assert stager.ring.num_leased() == 0
    assert stager.ring.num_reclaimed == 1
    assert stager.ring.take() is slot


def test_a_stale_reference_is_refused(puller: Puller) -> None:
    stager = _stager(ring_blocks=4)
    assert stager.ring is not None
    slot, old = _leased(stager, puller.process, _rows(3))
    stager.ring.revoke(slot)  # the holder took it back (its reply never went out) ...
    stager.ring.give_back(slot)
    _, new = _leased(stager, puller.process, _rows(4))  # ... and leased it again
    assert new.generation == old.generation + 1
    with pytest.raises(StaleSlot):
        SlotReader().open(old)


def test_an_unread_reply_is_released() -> None:
    me = this_process(NODE)
    assert me is not None
    stager = _stager(ring_blocks=4)
    assert stager.ring is not None
    _, ref = _leased(stager, me, _rows(5))
    assert stager.ring.num_leased() == 1
    SlotReader().release(ref)  # a cancelled pull's answer, never opened
    assert stager.ring.num_leased() == 0


def test_the_same_chunk_through_a_slot_and_through_a_buffer() -> None:
    """Both ways carry the same rows: the slot's view as the puller reads it in place, and the
    buffer's rows as they would be put into the object store."""
    me = this_process(NODE)
    assert me is not None
    stager = _stager(ring_blocks=4)
    assert stager.ring is not None
    stager.ring.give_back(_wait_for_slot(stager.ring))  # made, and free again
    rows = _rows(6)
    sent = []
    for puller in (me, None):  # through a slot, then through a buffer
        staging = stager.take(puller, len(rows))
        assert (staging.slot is not None) == (puller is not None)
        staging.buffer[: len(rows)] = torch.from_numpy(rows)
        payload = staging.buffer[: len(rows)].numpy()
        if puller is None:
            sent.append(payload.copy())  # what the object store would be given
        else:
            chunk = stager.ship(staging, KVChunk(0, "float32", payload, b"d" * 32))
            assert chunk.slot is not None and chunk.num_blocks == 0  # nothing inline
            sent.append(SlotReader().open(chunk.slot))
        stager.finish(staging, delivered=True)
    np.testing.assert_array_equal(sent[0], rows)
    np.testing.assert_array_equal(sent[1], rows)


def test_what_goes_through_the_object_store() -> None:
    me = this_process(NODE)
    assert me is not None
    stager = _stager(ring_blocks=4)  # one slot of 4 blocks
    assert stager.ring is not None
    held = _wait_for_slot(stager.ring)
    stager.ring.give_back(held)
    elsewhere = PullerProcess("node-b", me.pid, me.start_time)
    assert stager.take(elsewhere, 2).slot is None  # another node
    assert stager.take(me, 5).slot is None  # bigger than a slot
    assert stager.take(None, 2).slot is None  # a puller that offers no slots
    first = stager.take(me, 2)
    assert first.slot is held
    assert stager.take(me, 2).slot is None  # the ring is full (and may not grow)
    assert stager.ring.num_slots() == 1


def test_no_ring_without_room_for_a_slot() -> None:
    assert _stager(ring_blocks=3).ring is None  # less than one slot: off


def test_slots_prepared_for_a_pull_known_to_come() -> None:
    """A hand-off's prefill makes the slots its pull will want ahead of it: the pull's first
    chunks find them, none goes through the object store for want of a slot."""
    me = this_process(NODE)
    assert me is not None
    stager = _stager(ring_blocks=12)  # room for three slots of 4 blocks
    assert stager.ring is not None
    stager.prepare(9)  # three slots' worth
    deadline = time.monotonic() + 60
    while stager.ring.num_slots() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stager.ring.num_slots() == 3
    takes = [stager.take(me, 4) for _ in range(3)]
    assert all(t.slot is not None for t in takes)
    stager.prepare(40)  # never more than the ring holds
    assert stager.ring.num_slots() == 3
