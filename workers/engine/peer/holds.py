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

The pins go back at a step boundary once every block has been sent, or `ttl_s` after they were
taken (a decode worker that never asks), never while a copy of them is under way. A hold still
waiting for its blocks (its request queued behind others) is dropped after `PENDING_TTL_S`.
Holds take at most `max_blocks` of the device pool: beyond that a request is not held (its pull
pins at boundaries as any other).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachesvc.types import BlockHash
from workers.engine.peer.stage import PinnedRun, pin_run, unpin

# How long a hold may wait for its request's prompt to be computed (a queue of long prompts on a
# CPU is minutes), and how many may wait at once (an aborted request's never resolves).
PENDING_TTL_S = 600.0
MAX_PENDING = 256

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.engine import Engine


@dataclass
class _Hold:
    """One request's prompt: pending (`run` None) until its full blocks are all in the pool."""

    ids: list[int]
    hashes: list[BlockHash]
    cache_salt: str | None
    since_s: float  # when it was asked for, then when its blocks were pinned
    run: PinnedRun | None = None
    leased: int = 0  # copies of its blocks under way
    sent: set[int] = field(default_factory=set)  # block indexes shipped at least once

    @property
    def done(self) -> bool:
        return self.run is not None and len(self.sent) >= self.run.num_blocks


class HandoffHolds:
    """The holds of one worker. `expect` and `lease`/`give_back` run on the actor's event loop;
    `at_boundary` is the engine's step-boundary hook (the loop thread, between steps)."""

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._holds: list[_Hold] = []
        self._leases: dict[int, _Hold] = {}  # id of a leased slice -> its hold
        self.num_held = 0  # requests whose blocks were pinned by a hold
        self.num_served_chunks = 0  # chunks sent from held pins, without a step boundary

    def expect(
        self, ids: Sequence[int], hashes: Sequence[BlockHash], cache_salt: str | None
    ) -> None:
        """Hold the full blocks of prompt `ids` (`hashes`: its full blocks' under
        `cache_salt`) once computed, for a pull expected soon."""
        if hashes and len(hashes) <= self.max_blocks:
            pending = [h for h in self._holds if h.run is None]
            if len(pending) >= MAX_PENDING:
                self._holds.remove(pending[0])
            self._holds.append(_Hold(list(ids), list(hashes), cache_salt, time.monotonic()))

    def at_boundary(self, engine: Engine) -> None:
        """Pin the pending holds whose blocks are all computed; give back the pins of the ones
        sent in full or too old (none being copied)."""
        now = time.monotonic()
        kept: list[_Hold] = []
        for hold in self._holds:
            ttl = PENDING_TTL_S if hold.run is None else self.ttl_s
            expired = now - hold.since_s > ttl
            if hold.leased == 0 and (hold.done or expired):
                if hold.run is not None:
                    unpin(engine, hold.run)
                continue
            if hold.run is None and not expired:
                self._try_pin(engine, hold)
            kept.append(hold)
        self._holds = kept

    def _try_pin(self, engine: Engine, hold: _Hold) -> None:
        if self._pinned_blocks() + len(hold.hashes) > self.max_blocks:
            return
        want = len(hold.hashes)
        bs = engine.config.block_size
        last = hold.ids[(want - 1) * bs : want * bs]
        if engine.pool.lookup(hold.hashes[-1], last) is None:
            return  # blocks are computed in order: the last one missing, not all are there yet
        run = pin_run(engine, hold.ids, hold.cache_salt, 0, want, want, hold.hashes)
        if run.num_blocks == want:
            hold.run, hold.since_s = run, time.monotonic()
            self.num_held += 1
        else:  # not all computed yet (a chunked prefill) or some evicted: not this time
            unpin(engine, run)

    def lease(
        self, hashes: Sequence[BlockHash], start: int, end: int, max_blocks: int
    ) -> PinnedRun | None:
        """The held run of blocks `start .. end - 1` (at most `max_blocks`) of a prompt whose
        full blocks are `hashes`, when a hold has them pinned (None: pin the usual way). Give
        it back with `give_back` once copied."""
        if start >= end or start >= len(hashes):
            return None
        for hold in self._holds:
            run = hold.run
            if run is None or start >= run.num_blocks or hold.hashes[start] != hashes[start]:
                continue  # block hashes chain: one equal hash is an equal prefix up to it
            stop = min(end, start + max_blocks, run.num_blocks, len(hashes))
            stop = next((i for i in range(start, stop) if hold.hashes[i] != hashes[i]), stop)
            hold.leased += 1
            self.num_served_chunks += 1
            part = _slice(run, start, stop)
            self._leases[id(part)] = hold
            return part
        return None

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
            "peer_held_blocks": float(self._pinned_blocks()),
        }

    def _pinned_blocks(self) -> int:
        return sum(len(h.run.device) for h in self._holds if h.run is not None)


def _slice(run: PinnedRun, start: int, stop: int) -> PinnedRun:
    """Blocks `start .. stop - 1` of a run that starts at block 0."""
    num_device = len(run.device)
    device = run.device[start:stop]
    rows = run.tier_rows[max(0, start - num_device) : max(0, stop - num_device)]
    return PinnedRun(start, run.dtype, device, rows, run.hashes[start:stop], run.lossy)
