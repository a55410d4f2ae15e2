"""The simulator's event loop: arrivals routed by the router's own policy, steps timed.

Two kinds of events, in time order: a request arrives (the policy chooses among the workers,
from their load and the prefix index, through the router's own `router.placement.choose`), or a
worker's step ends (its requests advance, the next step starts at once if it has work). A
worker with nothing to compute but a pull under way is woken when the pull arrives (or by an
arrival before that). After every change a worker's KV events are applied to the shared
`MemoryPrefixIndex`, so routing sees each block as soon as the worker registered it (the live
router sees it a poll later).

With `peer_pull` (the router's and the workers' option together), each candidate sees the
longest prefix another worker holds, and the chosen worker is told the holder (the worker with
the longest match, when longer than its own), by the same function.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.events import TIER_HBM
from cachesvc.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.seq import SimPeer, SimSeq
from cachesvc.sim.trace import BLOCK_SIZE, SimRequest
from cachesvc.sim.worker import SimWorker
from cachesvc.types import WorkerId
from router.placement import LiveWorker, choose
from router.policy import Policy, RouteRequest, make_policy

_INCARNATION = "simulated"


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated cluster: workers and their capacities in blocks of the trace's size."""

    num_workers: int = 8
    device_blocks: int = 4096
    dram_blocks: int = 0
    nvme_blocks: int = 0
    block_size: int = BLOCK_SIZE  # tokens per block: the trace's (every request's)

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.device_blocks < 2:
            raise ValueError("a cluster needs a worker and at least 2 device blocks each")
        if self.dram_blocks < 0 or self.nvme_blocks < 0:
            raise ValueError("tier sizes must be >= 0 blocks")


@dataclass
class SimRun:
    """What one replay produced: every request's counters and the workers' totals."""

    policy: str
    peer_pull: bool
    seqs: list[SimSeq]
    workers: list[SimWorker]
    index: MemoryPrefixIndex
    reasons: Counter[str] = field(default_factory=Counter)
    assigned: dict[int, WorkerId] = field(default_factory=dict)  # request index -> worker
    num_rejected: int = 0  # requests no worker's pool could ever hold
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        """The policy, marked "+pull" with pulls between workers."""
        return f"{self.policy}+pull" if self.peer_pull else self.policy


class _Cluster:
    def __init__(
        self, spec: ClusterSpec, profile: CostProfile, policy: Policy, peer_pull: bool
    ) -> None:
        self.workers = [
            SimWorker(
                WorkerId(f"w{i}"),
                profile,
                spec.device_blocks,
                spec.dram_blocks,
                spec.nvme_blocks,
                spec.block_size,
                peer_pull,
            )
            for i in range(spec.num_workers)
        ]
        self.index = MemoryPrefixIndex()
        for w in self.workers:
            self.index.resync(w.worker_id, IndexSnapshot(_INCARNATION, 0, {}))
        self.policy = policy
        self.peer_pull = peer_pull
        self.events: list[tuple[float, int]] = []  # (a step's end or a wake-up, worker number)
        # Per worker: the time of its one live event (older ones in the heap are stale), and
        # whether that is the end of a step (else a wake-up for a pull, or nothing at all).
        self.due: list[float | None] = [None] * len(self.workers)
        self.stepping = [False] * len(self.workers)

    def sync(self, worker: SimWorker) -> None:
        """Feed the worker's new KV events to the index."""
        events = worker.events.drain()
        if events:
            applied = self.index.apply(worker.worker_id, _INCARNATION, events)
            assert applied, "the simulated event stream has no gaps"

    def start(self, number: int, now: float) -> None:
        """Start the worker's next step, or wait for its first pull, or go idle."""
        worker = self.workers[number]
        duration = worker.start_step(now)
        self.sync(worker)
        self.stepping[number] = duration is not None
        if duration is not None:
            due: float | None = now + duration
        else:
            wake = worker.next_pull_s
            due = None if wake is None else max(wake, now)
        self.due[number] = due
        if due is not None:
            heapq.heappush(self.events, (due, number))

    def route(self, req: SimRequest, run: SimRun) -> tuple[SimWorker, SimSeq] | None:
        """The worker the policy chooses, and the request as it joins that worker."""
        live = [w for w in self.workers if w.fits(req)]
        if not live:
            return None
        matches = self.index.longest_prefix(req.hashes[: req.num_full_blocks])
        loads = [
            LiveWorker(w.worker_id, w.num_requests, w.num_queued_tokens, w.block_costs())
            for w in live
        ]
        # Every simulated worker is healthy, so any may be the holder a pull comes from.
        holders = [w.worker_id for w in self.workers] if self.peer_pull else []
        request = RouteRequest(req.prompt_len, req.block_size, req.arrival_s)
        choice = choose(self.policy, request, loads, matches, holders)
        decision = choice.decision
        run.reasons[decision.reason] += 1
        run.assigned[req.index] = decision.worker
        worker = next(w for w in live if w.worker_id == decision.worker)
        match = matches.get(worker.worker_id)
        device = 0 if match is None else match.blocks_by_tier.get(TIER_HBM, 0)
        peer = None
        if choice.holder is not None:
            holder = next(w for w in self.workers if w.worker_id == choice.holder)
            peer = SimPeer(holder, choice.holder_blocks)
        return worker, SimSeq(req, device, peer)


def replay(
    requests: Sequence[SimRequest],
    profile: CostProfile,
    spec: ClusterSpec,
    policy: str,
    policy_options: Mapping[str, Any] | None = None,
    peer_pull: bool = False,
) -> SimRun:
    """Replay `requests` (in arrival order) through a fresh cluster routed by `policy`; with
    `peer_pull`, workers pull prefixes from the holders the router names."""
    began = time.perf_counter()
    if any(r.block_size != spec.block_size for r in requests):
        raise ValueError(f"every request must have blocks of {spec.block_size} tokens")
    cluster = _Cluster(spec, profile, make_policy(policy, **(policy_options or {})), peer_pull)
    run = SimRun(policy, peer_pull, [], cluster.workers, cluster.index)
    events = cluster.events
    i = 0
    while i < len(requests) or events:
        if events and (i == len(requests) or events[0][0] <= requests[i].arrival_s):
            now, number = heapq.heappop(events)
            if cluster.due[number] != now:
                continue  # superseded: an arrival started a step while the worker waited
            # A wake-up ends no step: finishing one with nothing scheduled changes nothing.
            cluster.workers[number].finish_step(now)
            cluster.start(number, now)
            continue
        req = requests[i]
        i += 1
        routed = cluster.route(req, run)
        if routed is None:
            run.num_rejected += 1
            continue
        target, seq = routed
        run.seqs.append(seq)
        target.add(seq)
        number = cluster.workers.index(target)
        if not cluster.stepping[number]:
            cluster.start(number, req.arrival_s)
    run.wall_s = time.perf_counter() - began
    return run
