"""Where a holder stages a chunk, and how the chunk leaves: a same-node slot, else the object store.

For a puller on the holder's own Ray node (it says so: `slots.PullerProcess`), the holder gathers
the chunk straight into a slot of its `SlotRing` and answers with the slot's `SlotRef`: the
gather is the holder's only copy, and the puller reads the rows in place. For a puller on another
node, or when the ring is full or off, the holder gathers into one of its reused host buffers and
the sealed payload is copied into Ray's object store (`ray_link.put_payload`), after which the
buffer serves the next chunk. Either way the chunk is the same bytes under the same digest. A
slot's lease ends by the puller's message (`release`) or, for a reply that never went out, here
(`finish`).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.transfer.chunk import KVChunk
from workers.transfer.slot_ring import Slot, SlotRing
from workers.transfer.slots import PullerProcess, SlotLease, SlotRef


@dataclass(eq=False)
class Staging:
    """Room for one chunk: `buffer` is `[num_blocks, *block_shape]`, a view of `slot` when the
    chunk goes through a slot to `puller`."""

    buffer: torch.Tensor
    slot: Slot | None = None
    puller: PullerProcess | None = None
    ref: SlotRef | None = None  # once the slot is leased
    written: int | None = None  # bytes of the slot's data the chunk covers, once shipped


class Stager:
    """A holder's staging room: host buffers of `buffer_blocks` blocks (pinned when `pin`, so a
    GPU's gather reaches the host in one DMA) and, on a Ray node (`node_id`), a ring of at most
    `ring_bytes` of slots of `slot_blocks` blocks. Thread-safe."""

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        buffer_blocks: int,
        slot_blocks: int,
        ring_bytes: int,
        node_id: str | None,
        pin: bool = False,
    ) -> None:
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.buffer_blocks = max(1, buffer_blocks)
        self.slot_blocks = max(1, min(slot_blocks, self.buffer_blocks))
        self.node_id = node_id
        self.pin = pin
        self.block_bytes = torch.Size(self.block_shape).numel() * dtype.itemsize
        slot_bytes = self.slot_blocks * self.block_bytes
        num_slots = ring_bytes // slot_bytes
        self.ring = SlotRing(slot_bytes, num_slots) if num_slots else None
        self._buffers: list[torch.Tensor] = []  # free ones: fresh host memory's page faults
        # cost more than the copy itself on a CPU, so buffers are reused
        # A slot's tensor view, made once; it goes with a slot the ring retired.
        self._views: weakref.WeakKeyDictionary[Slot, torch.Tensor] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.num_local = 0  # chunks sent through a slot

    def near(self, puller: PullerProcess | None, num_blocks: int) -> bool:
        """Whether a chunk of `num_blocks` for `puller` may go through a slot."""
        return (
            self.ring is not None
            and puller is not None
            and self.node_id is not None
            and puller.node_id == self.node_id
            and num_blocks <= self.slot_blocks
        )

    def prepare(self, num_blocks: int) -> None:
        """Make the slots a same-node pull of `num_blocks` will want, ahead of it."""
        if self.ring is not None and self.node_id is not None:
            self.ring.prepare(-(-num_blocks // self.slot_blocks))

    def take(self, puller: PullerProcess | None, num_blocks: int) -> Staging:
        """Room for a chunk of at most `num_blocks` for `puller`: a slot when it is on this
        node and one is free, else a host buffer (made, the first times). Give it back with
        `finish`."""
        if self.ring is not None and self.near(puller, num_blocks):
            slot = self.ring.take()
            if slot is not None:
                return Staging(self._slot_view(slot), slot, puller)
        with self._lock:
            buffer = self._buffers.pop() if self._buffers else None
        if buffer is None:
            shape = (self.buffer_blocks, *self.block_shape)
            buffer = torch.empty(shape, dtype=self.dtype, pin_memory=self.pin)
        return Staging(buffer)

    def ship(self, staging: Staging, chunk: KVChunk) -> KVChunk:
        """The sealed chunk as it goes on the wire: its slot leased to the puller (the payload
        stays where it was gathered), else its payload copied into Ray's object store.
        Blocking (the copy): call it off the event loop."""
        if staging.slot is None or staging.puller is None:
            from workers.transfer.ray_link import put_payload

            return put_payload(chunk) if chunk.num_blocks else _bare(chunk)
        staging.written = chunk.payload.nbytes
        if not chunk.num_blocks:
            return _bare(chunk)  # nothing to lease: `finish` gives the slot back
        assert self.ring is not None
        staging.ref = self.ring.lease(staging.slot, staging.puller, chunk.payload)
        self.num_local += 1
        return dataclasses.replace(chunk, payload=chunk.payload[:0].copy(), slot=staging.ref)

    def finish(self, staging: Staging, delivered: bool) -> None:
        """The chunk left (`delivered`: its reply was sent) or was given up: a buffer serves
        the next chunk; a slot that was never leased is free again (once zeroed), and one leased
        for a reply that was never sent is taken back (nobody else would end its lease)."""
        if staging.slot is None:
            with self._lock:
                self._buffers.append(staging.buffer)
            return
        assert self.ring is not None
        if staging.ref is None:
            self.ring.give_back(staging.slot, staging.written)
        elif not delivered:
            self.ring.revoke(staging.slot, staging.ref)

    def release(self, leases: Sequence[SlotLease]) -> int:
        """End the leases a puller is done with (its message): how many were this holder's
        current leases, named with the capability each was issued with (others end nothing)."""
        ring = self.ring
        return 0 if ring is None else sum(ring.release(lease) for lease in leases)

    def counters(self) -> dict[str, float]:
        """The ring's state, for the load report: slots made, leased now, taken back from
        pullers that died, retired for a lease held too long; chunks sent through slots."""
        ring = self.ring
        return {
            "peer_exported_local_chunks": float(self.num_local),
            "peer_slots": float(0 if ring is None else ring.num_slots()),
            "peer_slots_leased": float(0 if ring is None else ring.num_leased()),
            "peer_slots_reclaimed": float(0 if ring is None else ring.num_reclaimed),
            "peer_slots_retired": float(0 if ring is None else ring.num_retired),
        }

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()

    def _slot_view(self, slot: Slot) -> torch.Tensor:
        """The slot's data as a `[slot_blocks, *block_shape]` tensor (made once per slot)."""
        with self._lock:
            view = self._views.get(slot)
            if view is None:
                count = self.slot_blocks * torch.Size(self.block_shape).numel()
                flat = torch.frombuffer(slot.data, dtype=self.dtype, count=count)
                view = self._views[slot] = flat.view(self.slot_blocks, *self.block_shape)
            return view


def _bare(chunk: KVChunk) -> KVChunk:
    """An empty chunk, sent inline: its payload no longer a view of the staging room."""
    return dataclasses.replace(chunk, payload=chunk.payload[:0].copy())
