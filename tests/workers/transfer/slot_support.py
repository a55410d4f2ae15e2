"""Same-node slots between real processes, for the slot tests: a puller in a process of its own,
a holder's staging room, and leased slots."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from workers.transfer.slot_reader import SlotReader
from workers.transfer.slot_ring import Slot, SlotRing
from workers.transfer.slots import PullerProcess, SlotLease, SlotRef
from workers.transfer.staging import Stager

NODE = "node-a"
HOLDER = "holder"  # the puller's name of the holder its leases go back to
BLOCK_SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, heads, head size

# A puller process: says who it is, then on each command opens a reference (and keeps the
# view), drops what it holds (and answers the leases it released: its messages to the holder),
# or exits.
PULLER = """
import gc, json, sys
import numpy as np, xxhash
from workers.transfer.slot_reader import SlotReader
from workers.transfer.slots import SlotRef, this_process
released = []
reader = SlotReader(lambda holder, lease: released.append(lease))
held = []
print(json.dumps(this_process(sys.argv[1]).__dict__), flush=True)
for line in sys.stdin:
    command, _, arg = line.strip().partition(" ")
    if command == "open":
        fields = json.loads(arg)
        ref = SlotRef(**{**fields, "shape": tuple(fields["shape"]),
                         "capability": bytes.fromhex(fields["capability"])})
        try:
            held.append(reader.open(ref, "holder"))
        except Exception as exc:
            print("refused", type(exc).__name__, flush=True)
            continue
        print(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(held[-1]).tobytes()), flush=True)
    elif command == "drop":
        held.clear()
        gc.collect()
        print(json.dumps([[l.segment_id, l.capability.hex()] for l in released]), flush=True)
        released.clear()
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
        """The checksum of the payload as the puller reads it in place, or `refused <error>`."""
        fields: dict[str, Any] = {**asdict(ref), "capability": ref.capability.hex()}
        return self._ask(f"open {json.dumps(fields)}")

    def drop(self) -> list[SlotLease]:
        """Drop every view it holds; the leases it released since it last dropped (what it
        sends its holder)."""
        pairs = json.loads(self._ask("drop"))
        return [SlotLease(segment, bytes.fromhex(capability)) for segment, capability in pairs]

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


def collecting_reader(sent: list[SlotLease]) -> SlotReader:
    """A reader whose releases are collected in `sent` (the link would send them)."""
    return SlotReader(lambda holder, lease: sent.append(lease))


def make_stager(ring_blocks: int, slot_blocks: int = 4) -> Stager:
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    return Stager(BLOCK_SHAPE, torch.float32, 8, slot_blocks, ring_blocks * block_bytes, NODE)


def wait_for_slot(ring: SlotRing) -> Slot:
    """A slot, once the ring made one (or zeroed one) on its thread: it does both off the
    caller's path."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        slot = ring.take()
        if slot is not None:
            return slot
        time.sleep(0.01)
    raise AssertionError("the ring had no free slot")


def leased(stager: Stager, puller: PullerProcess, rows: np.ndarray) -> tuple[Slot, SlotRef]:
    """A slot holding `rows`, leased to `puller` as an export leases it."""
    assert stager.ring is not None
    slot = wait_for_slot(stager.ring)
    data = np.frombuffer(slot.data, dtype=rows.dtype, count=rows.size).reshape(rows.shape)
    data[:] = rows
    return slot, stager.ring.lease(slot, puller, data)


def rows(seed: int, num: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num, *BLOCK_SHAPE)).astype(np.float32)
