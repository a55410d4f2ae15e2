"""The simulator's event loop: arrivals routed by the router's own policy, steps timed.

Two kinds of events, in time order: a request arrives (the policy chooses among the workers,
from their load and the prefix index, through the router's own `router.policy.placement.choose`), or
a worker's step ends (its requests advance, the next step starts at once if it has work). A
worker with nothing to compute but a pull under way is woken when the pull arrives (or by an
arrival before that). After every change a worker's KV events are applied to the shared
`MemoryPrefixIndex`, so routing sees each block as soon as the worker registered it (the live
router sees it a poll later).

With `peer_pull` (the router's and the workers' option together), each candidate sees the
longest prefix another worker holds, and the chosen worker is told the holder (the worker with
the longest match, when longer than its own), by the same function.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.kv.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.kv.types import WorkerId
from cachesvc.sim.admit import SimAdmission
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.pd import (
    COLOCATED,
    PDRoutes,
    Refused,
    choose_among,
    colocated_ttft_s,
    joining,
    roles_for,
)
from cachesvc.sim.seq import SimSeq
from cachesvc.sim.trace import BLOCK_SIZE, SimRequest
from cachesvc.sim.worker import Host, SimWorker
from router.policy.admission import Admission
from router.policy.pd import PREFILL
from router.policy.pd import SLO as TargetsSLO
from router.policy.routing import Policy, make_policy
from router.policy.stream_gaps import RecentGaps

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


@dataclass(frozen=True)
class PDSetup:
    """Prefill/decode roles (`cachesvc.sim.pd`): the mode, and with roles how many of the
    workers are prefill workers (the first ones; the rest decode)."""

    mode: str = COLOCATED
    num_prefill: int = 0
    stall_weight: float = 1.0  # `router.policy.pd.decide`'s weight of the decode streams' loss
    slo: TargetsSLO | None = None  # the router's latency targets for `decide` (None: none)
    # The decode worker pulls while the prefill runs, each step's blocks once computed (the
    # router's `pd_prefetch`); off: from the first token on.
    prefetch: bool = True
    # The prefill workers' step budget, when not the profile's (`serve --prefill-chunk-tokens`).
    prefill_chunk_tokens: int | None = None
    # The router's admission targets (`admit_ttft_ms`, `admit_itl_ms`; `cachesvc.sim.admit`):
    # by default every request is admitted.
    admit: Admission = Admission()


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
    refused: list[SimRequest] = field(default_factory=list)  # admission refused these
    wall_s: float = 0.0
    pd: PDSetup | None = None
    pd_routes: PDRoutes | None = None  # with roles: each request's `PDDecision`

    @property
    def label(self) -> str:
        """The policy, marked "+pull" with pulls between workers."""
        return f"{self.policy}+pull" if self.peer_pull else self.policy


class _Cluster:
    def __init__(
        self,
        spec: ClusterSpec,
        profile: CostProfile,
        policy: Policy,
        peer_pull: bool,
        pd: PDSetup | None = None,
    ) -> None:
        setup = pd or PDSetup()
        roles = roles_for(setup.mode, spec.num_workers, setup.num_prefill)
        host = Host()  # the workers share one machine (the profile's contention)
        chunked, chunk = profile, setup.prefill_chunk_tokens
        if chunk is not None:  # the prefill workers' own step budget
            chunked = dataclasses.replace(profile, max_num_batched_tokens=chunk)
        self.workers = [
            SimWorker(
                WorkerId(f"w{i}"),
                chunked if roles[i] == PREFILL else profile,
                spec.device_blocks,
                spec.dram_blocks,
                spec.nvme_blocks,
                spec.block_size,
                # With roles a decode worker pulls its prompts; every mode's workers can (and
                # so report a pull cost), whether the router names holders or not.
                peer_pull or pd is not None,
                roles[i],
                host,
            )
            for i in range(spec.num_workers)
        ]
        self.index = MemoryPrefixIndex()
        for w in self.workers:
            self.index.resync(w.worker_id, IndexSnapshot(_INCARNATION, 0, {}))
        self.policy = policy
        self.peer_pull = peer_pull
        self.admission = SimAdmission(setup.admit)
        if setup.admit.itl_s is not None:
            for w in self.workers:
                w.gaps = RecentGaps()
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

    def route(self, req: SimRequest, run: SimRun) -> tuple[SimWorker, SimSeq] | Refused | None:
        """The worker the policy chooses (with roles, `PDRoutes`'), and the request as it
        joins that worker; `Refused` when admission refuses it, None when no worker could
        ever hold it."""
        if run.pd_routes is not None:
            routed = run.pd_routes.route(req)
            if routed is None or isinstance(routed, Refused):
                return routed
            run.reasons[routed.reason] += 1
            run.assigned[req.index] = routed.worker.worker_id
            return routed.worker, routed.seq
        live = [w for w in self.workers if w.fits(req)]
        if not live:
            return None
        matches = self.index.longest_prefix(req.hashes[: req.num_full_blocks])
        # Every simulated worker is healthy, so any may be the holder a pull comes from.
        holders = [w.worker_id for w in self.workers] if self.peer_pull else []
        worker, choice = choose_among(self.policy, req, live, matches, holders)
        # Recorded before admission, as the router's `Placement.route` records its choice.
        choice.asked.record(worker.worker_id)
        predicted = 0.0
        if self.admission.on:
            predicted, queued = colocated_ttft_s(req, worker, choice.decision.matched_blocks)
            stalls = [(worker, predicted - queued)]  # its streams lose the prompt's compute
            refusal = self.admission.refusal(predicted, queued, stalls, req.arrival_s)
            if refusal is not None:
                return Refused(refusal)
        run.reasons[choice.decision.reason] += 1
        run.assigned[req.index] = worker.worker_id
        seq = joining(req, worker, choice, matches, self.workers)
        self.admission.admitted(seq, predicted)
        return worker, seq

    def join(self, worker: SimWorker, seq: SimSeq, now: float, run: SimRun) -> None:
        """`seq` joins `worker`'s queue; an idle worker starts stepping."""
        run.seqs.append(seq)
        worker.add(seq)
        number = self.workers.index(worker)
        if not self.stepping[number]:
            self.start(number, now)


def replay(
    requests: Sequence[SimRequest],
    profile: CostProfile,
    spec: ClusterSpec,
    policy: str | Policy,
    policy_options: Mapping[str, Any] | None = None,
    peer_pull: bool = False,
    pd: PDSetup | None = None,
) -> SimRun:
    """Replay `requests` (in arrival order) through a fresh cluster routed by `policy` (a
    registry name and its options, or a fresh policy); with `peer_pull`, workers pull prefixes
    from the holders the router names; with `pd`, workers have prefill/decode roles and
    requests go where its mode says (`cachesvc.sim.pd`)."""
    began = time.perf_counter()
    if any(r.block_size != spec.block_size for r in requests):
        raise ValueError(f"every request must have blocks of {spec.block_size} tokens")
    options = policy_options or {}
    chooser = make_policy(policy, **options) if isinstance(policy, str) else policy
    cluster = _Cluster(spec, profile, chooser, peer_pull, pd)
    run = SimRun(chooser.name, peer_pull, [], cluster.workers, cluster.index, pd=pd)
    if pd is not None and pd.mode != COLOCATED:
        run.pd_routes = PDRoutes(
            pd.mode,
            cluster.workers,
            cluster.index,
            cluster.policy,
            pd.stall_weight,
            peer_pull,
            pd.slo,
            pd.prefetch,
            cluster.admission,
        )
    events = cluster.events
    i = 0
    while i < len(requests) or events:
        if events and (i == len(requests) or events[0][0] <= requests[i].arrival_s):
            now, number = heapq.heappop(events)
            if cluster.due[number] != now:
                continue  # superseded: an arrival started a step while the worker waited
            # A wake-up ends no step: finishing one with nothing scheduled changes nothing.
            worker = cluster.workers[number]
            finished = worker.finish_step(now)
            cluster.start(number, now)
            for seq in finished:
                if run.pd_routes is None:
                    cluster.admission.answered(seq)
                handed = run.pd_routes.handoff(worker, seq) if run.pd_routes else None
                if handed is not None:  # its prefill is done: its decode joins the decoder
                    cluster.join(handed[0], handed[1], now, run)
            continue
        req = requests[i]
        i += 1
        routed = cluster.route(req, run)
        if routed is None:
            run.num_rejected += 1
            continue
        if isinstance(routed, Refused):
            run.refused.append(req)
            continue
        cluster.join(routed[0], routed[1], req.arrival_s, run)
    run.wall_s = time.perf_counter() - began
    return run
