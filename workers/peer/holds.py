"""A prefill worker's KV kept pinned for the decode worker that will pull it.

When the router hands a request off, its prefill worker computes the prompt and its first token,
and only then does the decode worker ask for the prompt's blocks. Pinned the ordinary way (at the
holder's next step boundary, `export.ChunkExporter`), every chunk of that pull waits for the step
the prefill worker has started meanwhile: on a CPU that is the next long prompt, seconds. A
request the router marks for a hand-off (`hold_kv`) is held instead: at the first step boundary
at which the pool holds all of its prompt's full blocks (the step that computed the last of them,
usually the one that sampled the first token), they are pinned there and then, and the pull's
chunks are served from those pins without waiting for a boundary: a full cached block is never
written again, so it may be copied beside a step.

Blocks are pinned as they are computed, not only once all are: at each boundary a hold pins the
leading blocks computed since the last (a prompt prefilled in chunks grows its run chunk by chunk),
and a pull that asks for blocks not computed yet may wait for them (`wait_for`). So a decode
worker can pull a handed-off prompt while its prefill still runs (`workers.peer.prefetch`).

The pins go back at a step boundary once every block has been sent, when the hold is released
(`release`: its request was aborted or stopped before a pull, or the router says the hand-off is
over or will not happen), or `ttl_s` after they were taken (a decode worker that never asks and a
router that never says), never while a copy of them is under way. A hold still
waiting for its blocks (its request queued behind others) is dropped after `PENDING_TTL_S`.
Holds take at most `max_blocks` of the device pool: beyond that a request is not held (its pull
pins at boundaries as any other).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachesvc.kv.types import BlockHash
from workers.peer.stage import PinnedRun, pin_run, unpin

# How long a hold may wait for its request's prompt to be computed (a queue of long prompts on a
# CPU is minutes), and how many may wait at once (an aborted request's never resolves).
PENDING_TTL_S = 600.0
MAX_PENDING = 256

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.engine import Engine


@dataclass
class _Hold:
    """One request's prompt: its leading blocks pinned so far, in runs taken at successive
    boundaries (`complete` once all of its full blocks are)."""

    ids: list[int]
    hashes: list[BlockHash]
    cache_salt: str | None
    since_s: float  # when it was asked for, then when its last blocks were pinned
    runs: list[PinnedRun] = field(default_factory=list)
    leased: int = 0  # copies of its blocks under way
    sent: set[int] = field(default_factory=set)  # block indexes shipped at least once
    released: bool = False  # no pull needs it any more: it pins nothing more and serves none

    @property
    def num_pinned(self) -> int:
        return sum(r.num_blocks for r in self.runs)

    @property
    def complete(self) -> bool:
        return self.num_pinned >= len(self.hashes)

    @property
    def done(self) -> bool:
        return self.complete and len(self.sent) >= len(self.hashes)

    def run_at(self, start: int) -> PinnedRun | None:
        """The pinned run that holds block `start`."""
        return next((r for r in self.runs if r.start_block <= start < r.end_block), None)


class HandoffHolds:
    """The holds of one worker. `expect` and `lease`/`give_back` run on the actor's event loop;
    `at_boundary` is the engine's step-boundary hook (the loop thread, between steps)."""

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._holds: list[_Hold] = []
        self._leases: dict[int, _Hold] = {}  # id of a leased slice -> its hold
        self.num_held = 0  # requests whose blocks were all pinned by a hold
        self.num_served_chunks = 0  # chunks sent from held pins, without a step boundary
        self.num_early_chunks = 0  # of those, sent before the hold had all of its blocks
        self._grew: asyncio.Event | None = None  # set (and replaced) when a hold pins more

    def expect(
        self, ids: Sequence[int], hashes: Sequence[BlockHash], cache_salt: str | None
    ) -> None:
        """Hold the full blocks of prompt `ids` (`hashes`: its full blocks' under
        `cache_salt`) as they are computed, for a pull expected soon (once: a prompt already
        held is not held twice)."""
        if hashes and self._find(hashes, len(hashes) - 1) is not None:
            return
        if hashes and len(hashes) <= self.max_blocks:
            pending = [h for h in self._holds if not h.runs]  # none of its blocks computed
            if len(pending) >= MAX_PENDING:
                self._holds.remove(pending[0])
            self._holds.append(_Hold(list(ids), list(hashes), cache_salt, time.monotonic()))

    def at_boundary(self, engine: Engine) -> None:
        """Pin the blocks the holds' prompts computed since the last boundary; give back the
        pins of the holds sent in full or too old (none being copied)."""
        now = time.monotonic()
        kept: list[_Hold] = []
        grew = False
        for hold in self._holds:
            # Waiting for its prompt to be reached is long; between its chunks, or for its
            # puller once some are pinned, it is not.
            ttl = self.ttl_s if hold.runs else PENDING_TTL_S
            expired = now - hold.since_s > ttl or hold.released
            if hold.leased == 0 and (hold.done or expired):
                for run in hold.runs:
                    unpin(engine, run)
                continue
            if not hold.complete and not expired:
                grew = self._pin_more(engine, hold) or grew
            kept.append(hold)
        dropped = len(kept) < len(self._holds)
        self._holds = kept
        if grew or dropped:  # a pull waiting for blocks looks again
            self._wake()

    def _pin_more(self, engine: Engine, hold: _Hold) -> bool:
        """Pin the blocks of `hold` computed since its last pins (blocks are computed in
        order); True when some were."""
        have, want = hold.num_pinned, len(hold.hashes)
        if not hold.runs and self._reserved() + want > self.max_blocks:
            return False  # a hold starts only when all of its blocks fit beside the others'
        bs = engine.config.block_size
        if engine.pool.lookup(hold.hashes[have], hold.ids[have * bs : (have + 1) * bs]) is None:
            return False  # the next block is not computed yet: nothing to pin this time
        run = pin_run(engine, hold.ids, hold.cache_salt, have, want, want - have, hold.hashes)
        if run.num_blocks == 0:
            unpin(engine, run)
            return False
        last = hold.runs[-1] if hold.runs else None
        if last is not None and not last.tier_rows:  # one run: a chunk may span two boundaries
            hold.runs[-1] = _joined(last, run)
        else:
            hold.runs.append(run)
        hold.since_s = time.monotonic()
        self.num_held += int(hold.complete)
        return True

    async def wait_for(
        self, hashes: Sequence[BlockHash], start: int, end: int, timeout_s: float
    ) -> None:
        """Wait until blocks `start .. end - 1` of the prompt whose full blocks are `hashes`
        (those it has) are pinned by a hold, or no hold is computing them any more, or
        `timeout_s` passed. On the actor's loop."""
        deadline = time.monotonic() + timeout_s
        while True:
            hold = self._find(hashes, start)
            if hold is None or hold.complete or hold.num_pinned >= min(end, len(hold.hashes)):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._grew is None:
                self._grew = asyncio.Event()
            try:
                await asyncio.wait_for(self._grew.wait(), left)
            except TimeoutError:
                return

    def _wake(self) -> None:
        if self._grew is not None:
            self._grew.set()
            self._grew = None

    def _find(self, hashes: Sequence[BlockHash], start: int) -> _Hold | None:
        """The hold of a prompt that shares `hashes` up to block `start` (hashes chain: one
        equal hash is an equal prefix up to it)."""
        if start >= len(hashes):
            return None
        return next(
            (
                h
                for h in self._holds
                if not h.released and start < len(h.hashes) and h.hashes[start] == hashes[start]
            ),
            None,
        )

    def lease(
        self, hashes: Sequence[BlockHash], start: int, end: int, max_blocks: int
    ) -> PinnedRun | None:
        """The held run of blocks `start .. end - 1` (at most `max_blocks`) of a prompt whose
        full blocks are `hashes`, when a hold has them pinned (None: pin the usual way). Give
        it back with `give_back` once copied."""
        if start >= end or start >= len(hashes):
            return None
        for hold in self._holds:
            run = hold.run_at(start)
            if run is None or hold.released or hold.hashes[start] != hashes[start]:
                continue  # block hashes chain: one equal hash is an equal prefix up to it
            stop = min(end, start + max_blocks, run.end_block, len(hashes))
            stop = next((i for i in range(start, stop) if hold.hashes[i] != hashes[i]), stop)
            hold.leased += 1
            self.num_served_chunks += 1
            self.num_early_chunks += int(not hold.complete)
            part = _slice(run, start, stop)
            self._leases[id(part)] = hold
            return part
        return None

    def release(self, ids: Sequence[int], cache_salt: str | None) -> bool:
        """Let go of the hold of prompt `ids` under `cache_salt`: no pull of it will come (its
        request was aborted, or ended before a hand-off) or none is needed any more. Its pins go
        back at the next boundary, or once the copies of them under way end; a later pull of the
        prompt pins the usual way. True when there was one: the caller runs `at_boundary` when
        it can. On the actor's event loop."""
        wanted = list(ids)
        hold = next(
            (
                h
                for h in self._holds
                if not h.released and h.cache_salt == cache_salt and h.ids == wanted
            ),
            None,
        )
        if hold is None:
            return False
        hold.released = True
        self._wake()  # a pull waiting for its blocks stops waiting
        return True

    def give_back(self, run: PinnedRun, delivered: bool) -> bool:
        """A leased run's copy is over (`delivered`: it reached the puller). True when its hold
        may now go (sent in full): the caller runs `at_boundary` when it can."""
        hold = self._leases.pop(id(run), None)
        if hold is None:
            return False
        hold.leased -= 1
        if delivered:
            hold.sent.update(range(run.start_block, run.start_block + run.num_blocks))
        return hold.leased == 0 and hold.done

    def counters(self) -> dict[str, float]:
        return {
            "peer_held_requests": float(self.num_held),
            "peer_held_chunks": float(self.num_served_chunks),
            "peer_held_early_chunks": float(self.num_early_chunks),
            "peer_held_blocks": float(self._pinned_blocks()),
        }

    def _reserved(self) -> int:
        """Blocks of the holds that started pinning, pinned or still to come."""
        return sum(len(h.hashes) for h in self._holds if h.runs)

    def _pinned_blocks(self) -> int:
        return sum(len(r.device) for h in self._holds for r in h.runs)


def _joined(first: PinnedRun, then: PinnedRun) -> PinnedRun:
    """One run of `first` (device blocks only) and the run pinned right after it."""
    device = first.device + then.device
    hashes = first.hashes + then.hashes
    lossy = first.lossy or then.lossy
    return PinnedRun(first.start_block, first.dtype, device, then.tier_rows, hashes, lossy)


def _slice(run: PinnedRun, start: int, stop: int) -> PinnedRun:
    """Blocks `start .. stop - 1` of a run (indexes of the prompt's blocks)."""
    num_device = len(run.device)
    lo, hi = start - run.start_block, stop - run.start_block
    device = run.device[lo:hi]
    rows = run.tier_rows[max(0, lo - num_device) : max(0, hi - num_device)]
    return PinnedRun(start, run.dtype, device, rows, run.hashes[lo:hi], run.lossy)
