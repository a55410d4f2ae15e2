"""Same-node slots between real processes: a holder's slot is read in place by another process,
stays the puller's while it holds a view of it, is free again once the puller's release comes,
and is taken back when the puller is killed; a full ring, a puller on another node or a chunk
bigger than a slot goes through the object store instead; a stale reference is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
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

from workers.transfer.chunk import KVChunk
from workers.transfer.slot_reader import StaleSlot
from workers.transfer.slots import PullerProcess, SlotLease, this_process


@pytest.fixture
def puller() -> Iterator[Puller]:
    p = Puller()
    yield p
    p.close()


def test_a_slot_is_read_in_place_and_free_once_released(puller: Puller) -> None:
    stager = make_stager(ring_blocks=4)  # one slot
    assert stager.ring is not None
    payload = rows(1)
    slot, ref = leased(stager, puller.process, payload)
    assert puller.open(ref) == xxhash.xxh3_64_hexdigest(payload.tobytes())
    # Held by the puller: the holder neither lists it free nor hands it out again.
    assert stager.ring.num_leased() == 1
    assert stager.ring.take() is None
    released = puller.drop()  # its views gone, the puller says so
    assert released == [ref.lease]
    assert stager.release(released) == 1
    assert stager.ring.num_leased() == 0
    assert wait_for_slot(stager.ring) is slot  # the same slot again, not a new one
    assert stager.ring.num_slots() == 1


def test_a_killed_puller_leaks_no_slot(puller: Puller) -> None:
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    slot, ref = leased(stager, puller.process, rows(2))
    puller.open(ref)
    assert stager.ring.num_leased() == 1
    puller.kill()  # no release ever comes: the holder sees the process gone
    assert stager.ring.num_leased() == 0
    assert stager.ring.num_reclaimed == 1
    assert wait_for_slot(stager.ring) is slot


def test_a_stale_reference_is_refused(puller: Puller) -> None:
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    slot, old = leased(stager, puller.process, rows(3))
    stager.ring.revoke(slot, old)  # the holder took it back (its reply never went out) ...
    _, new = leased(stager, puller.process, rows(4))  # ... and leased it again
    assert new.generation == old.generation + 1
    sent: list[SlotLease] = []
    with pytest.raises(StaleSlot):
        collecting_reader(sent).open(old, HOLDER)
    assert puller.open(old).startswith("refused")


def test_an_unread_reply_is_released() -> None:
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    _, ref = leased(stager, me, rows(5))
    assert stager.ring.num_leased() == 1
    sent: list[SlotLease] = []
    collecting_reader(sent).release(ref, HOLDER)  # a cancelled pull's answer, never opened
    assert stager.release(sent) == 1
    assert stager.ring.num_leased() == 0


def test_the_same_chunk_through_a_slot_and_through_a_buffer() -> None:
    """Both ways carry the same rows: the slot's view as the puller reads it in place, and the
    buffer's rows as they would be put into the object store."""
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)
    assert stager.ring is not None
    stager.ring.give_back(wait_for_slot(stager.ring), 0)  # made, and free again
    payload = rows(6)
    sent = []
    for puller in (me, None):  # through a slot, then through a buffer
        staging = stager.take(puller, len(payload))
        assert (staging.slot is not None) == (puller is not None)
        staging.buffer[: len(payload)] = torch.from_numpy(payload)
        staged = staging.buffer[: len(payload)].numpy()
        if puller is None:
            sent.append(staged.copy())  # what the object store would be given
        else:
            chunk = stager.ship(staging, KVChunk(0, "float32", staged, b"d" * 32))
            assert chunk.slot is not None and chunk.num_blocks == 0  # nothing inline
            sent.append(collecting_reader([]).open(chunk.slot, HOLDER))
        stager.finish(staging, delivered=True)
    np.testing.assert_array_equal(sent[0], payload)
    np.testing.assert_array_equal(sent[1], payload)


def test_what_goes_through_the_object_store() -> None:
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=4)  # one slot of 4 blocks
    assert stager.ring is not None
    held = wait_for_slot(stager.ring)
    stager.ring.give_back(held, 0)
    elsewhere = PullerProcess("node-b", me.pid, me.start_time)
    assert stager.take(elsewhere, 2).slot is None  # another node
    assert stager.take(me, 5).slot is None  # bigger than a slot
    assert stager.take(None, 2).slot is None  # a puller that offers no slots
    first = stager.take(me, 2)
    assert first.slot is held
    assert stager.take(me, 2).slot is None  # the ring is full (and may not grow)
    assert stager.ring.num_slots() == 1


def test_no_ring_without_room_for_a_slot() -> None:
    assert make_stager(ring_blocks=3).ring is None  # less than one slot: off


def test_slots_prepared_for_a_pull_known_to_come() -> None:
    """A hand-off's prefill makes the slots its pull will want ahead of it: the pull's first
    chunks find them, none goes through the object store for want of a slot."""
    me = this_process(NODE)
    assert me is not None
    stager = make_stager(ring_blocks=12)  # room for three slots of 4 blocks
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
