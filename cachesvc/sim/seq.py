"""A request on a simulated worker: its counters, the load pending on it, the holder it may pull
from. The engine's `Request` without tokens; `worker` schedules it, `loads`
plans and lands what its tiers and a holder add to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachesvc.kv.types import BlockHash, BlockId, WorkerId
from cachesvc.sim.trace import SimRequest

Ranges = list[tuple[str, list[BlockHash]]]


class Holder(Protocol):
    """A worker a request may pull blocks from (a `SimWorker`)."""

    worker_id: WorkerId

    def num_held(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` it holds, on the device or in a local tier (what it
        would send); does not touch its cache."""
        ...

    def charge(self, seconds: float) -> None:
        """Add `seconds` to its next step: what staging a pull's blocks costs its engine."""
        ...


@dataclass(frozen=True)
class SimPeer:
    """The router's holder hint: `holder` held the first `num_blocks` full blocks of the
    prompt when the request was routed."""

    holder: Holder
    num_blocks: int


@dataclass(frozen=True)
class EarlyPull:
    """A decode worker's pull while the prefill ran (the router's `pd_prefetch`): asked for at
    `start_s`, each chunk's blocks sent once computed (`chunks`: full blocks computed by then,
    and when), one after another over the link."""

    start_s: float
    chunks: tuple[tuple[int, float], ...]


@dataclass
class PendingLoad:
    """Blocks planned to land once the request is computed up to `split_token`: the back of a
    split read from the tiers while the front is computed, or a pull (nothing computed before
    it, for a plain fetch)."""

    split_token: int
    ranges: Ranges  # the local ones pinned until they land or are dropped; a pull's last
    ready_s: float  # when the reads (and the pull) are done
    # A pull: the blocks the holder sends (it may have lost the tail since it was routed to);
    # None without one. The engine does not wait for a pull, the request does.
    peer_blocks: int | None = None

    @property
    def is_pull(self) -> bool:
        return self.peer_blocks is not None


@dataclass(eq=False)
class SimSeq:
    """A request on a worker: its counters, as the engine's `Request` keeps them."""

    req: SimRequest
    routed_blocks: int = 0  # device blocks the router saw it hit (the load estimate's)
    peer: SimPeer | None = None  # a holder of a longer prefix, with pulls on
    block_ids: list[BlockId] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens served per tier
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    load: PendingLoad | None = None
    # Prefill/decode disaggregation: a request's prefill on a prefill worker stops after its
    # first token (`prefill_only`); its decode on a decode worker starts with that token,
    # pulls the prompt's full blocks from `peer` and computes the rest (`pulls_prompt`).
    prefill_only: bool = False
    pulls_prompt: bool = False
    # A prefill's full blocks computed at the end of each of its steps, and when (what a pull
    # made while it runs gets); a decode's pull made while its prefill ran, if any.
    chunk_times: list[tuple[int, float]] = field(default_factory=list)
    early: EarlyPull | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token came
    num_computed: int = 0  # tokens this worker computed for it, recomputations included

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_len + self.generated

    @property
    def num_to_generate(self) -> int:
        """Output tokens it produces here before it is done (1 for a prefill only)."""
        return 1 if self.prefill_only else self.req.output_len

    def awaits_load(self) -> bool:
        """Computed up to its pending load: nothing to compute until it lands."""
        return self.load is not None and self.computed >= self.load.split_token
