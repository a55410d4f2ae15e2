"""The simulator's event loop: arrivals routed by the router's own policy, steps timed.

Two kinds of events, in time order: a request arrives (the policy chooses among the workers,
from their load and the prefix index, exactly as `router.core` builds its candidates), or a
worker's step ends (its requests advance, the next step starts at once if it has work). After
every change a worker's KV events are applied to the shared `MemoryPrefixIndex`, so routing
sees each block as soon as the worker registered it (the live router sees it a poll later).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.bench.simulate_profile import CostProfile
from cachesvc.bench.simulate_trace import BLOCK_SIZE, SimRequest
from cachesvc.bench.simulate_worker import SimSeq, SimWorker
from cachesvc.events import TIER_HBM
from cachesvc.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.types import WorkerId
from router.policy import Candidate, Policy, RouteRequest, make_policy

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
    seqs: list[SimSeq]
    workers: list[SimWorker]
    index: MemoryPrefixIndex
    reasons: Counter[str] = field(default_factory=Counter)
    assigned: dict[int, WorkerId] = field(default_factory=dict)  # request index -> worker
    num_rejected: int = 0  # requests no worker's pool could ever hold
    wall_s: float = 0.0


class _Cluster:
    def __init__(self, spec: ClusterSpec, profile: CostProfile, policy: Policy) -> None:
        self.workers = [
            SimWorker(
                WorkerId(f"w{i}"),
                profile,
                spec.device_blocks,
                spec.dram_blocks,
                spec.nvme_blocks,
                spec.block_size,
            )
            for i in range(spec.num_workers)
        ]
        self.index = MemoryPrefixIndex()
        for w in self.workers:
            self.index.resync(w.worker_id, IndexSnapshot(_INCARNATION, 0, {}))
        self.policy = policy
        self.steps: list[tuple[float, int]] = []  # (end of the running step, worker number)
        self.stepping = [False] * len(self.workers)

    def sync(self, worker: SimWorker) -> None:
        """Feed the worker's new KV events to the index."""
        events = worker.events.drain()
        if events:
            applied = self.index.apply(worker.worker_id, _INCARNATION, events)
            assert applied, "the simulated event stream has no gaps"

    def start(self, number: int, now: float) -> None:
        worker = self.workers[number]
        duration = worker.start_step(now)
        self.sync(worker)
        self.stepping[number] = duration is not None
        if duration is not None:
            heapq.heappush(self.steps, (now + duration, number))

    def route(self, req: SimRequest, run: SimRun) -> tuple[SimWorker, int] | None:
        """The worker the policy chooses, and the device blocks of the request it holds."""
        live = [w for w in self.workers if w.fits(req)]
        if not live:
            return None
        matches = self.index.longest_prefix(req.hashes[: req.num_full_blocks])
        candidates = [
            Candidate(
                w.worker_id,
                w.num_requests,
                w.num_queued_tokens,
                matches.get(w.worker_id),
                w.block_costs(),
            )
            for w in live
        ]
        request = RouteRequest(req.prompt_len, req.block_size)
        decision = self.policy.choose(request, candidates)
        run.reasons[decision.reason] += 1
        run.assigned[req.index] = decision.worker
        worker = next(w for w in live if w.worker_id == decision.worker)
        match = matches.get(worker.worker_id)
        return worker, 0 if match is None else match.blocks_by_tier.get(TIER_HBM, 0)


def replay(
    requests: Sequence[SimRequest],
    profile: CostProfile,
    spec: ClusterSpec,
    policy: str,
    policy_options: Mapping[str, Any] | None = None,
) -> SimRun:
    """Replay `requests` (in arrival order) through a fresh cluster routed by `policy`."""
    began = time.perf_counter()
    if any(r.block_size != spec.block_size for r in requests):
        raise ValueError(f"every request must have blocks of {spec.block_size} tokens")
    cluster = _Cluster(spec, profile, make_policy(policy, **(policy_options or {})))
    run = SimRun(policy, [], cluster.workers, cluster.index)
    steps = cluster.steps
    i = 0
    while i < len(requests) or steps:
        if steps and (i == len(requests) or steps[0][0] <= requests[i].arrival_s):
            now, number = heapq.heappop(steps)
            worker = cluster.workers[number]
            worker.finish_step(now)
            cluster.start(number, now)
            continue
        req = requests[i]
        i += 1
        routed = cluster.route(req, run)
        if routed is None:
            run.num_rejected += 1
            continue
        target, device_blocks = routed
        seq = SimSeq(req, routed_blocks=device_blocks)
        run.seqs.append(seq)
        target.add(seq)
        number = cluster.workers.index(target)
        if not cluster.stepping[number]:
            cluster.start(number, req.arrival_s)
    run.wall_s = time.perf_counter() - began
    return run
