"""Where a request goes: the live candidates as a policy sees them, its choice, and the holder
a chosen worker may pull the prefix from.

`choose` is the one place that turns live workers' loads and the prefix index's matches into
`Candidate`s (with, when pulls are on, the longest prefix another holder has), asks the policy,
and names the holder to a chosen worker that pulls: the router (`Placement`, over its pool) and
the simulator (`cachesvc.sim.loop`, over its simulated workers) both route through it. It
records nothing: what was asked (`Asked`) records, once known, the worker the request runs on
(the policy's choice, or the decode worker of a request handed off). Pure reads of the pool.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from cachesvc.index import PrefixMatch
from cachesvc.types import BlockHash, WorkerId
from router.affinity import AffinityTable
from router.config import RouterConfig
from router.domain import Exhausted, Unavailable
from router.pd import MIXED
from router.policy import Candidate, Policy, RouteDecision, RouteRequest, can_pull
from router.pool import WorkerPool
from router.worker_state import WorkerState
from workers.protocol import BlockCosts, HolderHint


@dataclass(frozen=True)
class LiveWorker:
    """A worker a request may go to, before the index is asked: its load and its costs."""

    worker: WorkerId
    num_requests: int
    num_queued_tokens: int
    costs: BlockCosts | None = None


@dataclass(frozen=True)
class Asked:
    """What a policy was asked for one request: the request and the candidates as it saw
    them; `record` tells it, once, where the request runs."""

    policy: Policy
    request: RouteRequest
    candidates: tuple[Candidate, ...]

    def record(self, worker: WorkerId, pulled_blocks: int = 0) -> None:
        """The request runs on `worker`: the policy's choice, or another worker it saw (a
        hand-off's decode worker, which pulls the prompt's first `pulled_blocks` from the
        worker that computed them: its prefill there is what that pull costs it). Nothing
        when the policy did not see `worker`: it remembers the workers it chooses among."""
        runs = next((c for c in self.candidates if c.worker == worker), None)
        if runs is None:
            return
        candidates = self.candidates
        if pulled_blocks > runs.peer_blocks:
            pulling = dataclasses.replace(runs, peer_blocks=pulled_blocks)
            candidates = tuple(pulling if c is runs else c for c in candidates)
        self.policy.record(self.request, candidates, worker)


@dataclass(frozen=True)
class Choice:
    """The policy's decision (not recorded: `asked`), and the holder the chosen worker may
    pull from (None: none)."""

    decision: RouteDecision
    asked: Asked
    holder: WorkerId | None = None
    holder_blocks: int = 0  # leading blocks of the prompt the holder has


def choose(
    policy: Policy,
    request: RouteRequest,
    live: Sequence[LiveWorker],
    matches: Mapping[WorkerId, PrefixMatch],
    holders: Collection[WorkerId] = (),
) -> Choice:
    """Ask `policy` to choose among `live` (never empty), each seeing its own match and the
    longest prefix one of the other `holders` has (the workers a pull may come from; empty
    with pulls off). The holder is named only to a chosen worker that pulls (`can_pull`) and
    only when it has more than the chosen worker holds. Nothing recorded (`Choice.asked`)."""
    held = {w: m.num_blocks for w, m in matches.items() if w in holders}
    candidates = tuple(
        Candidate(
            w.worker,
            w.num_requests,
            w.num_queued_tokens,
            matches.get(w.worker),
            w.costs,
            max((n for h, n in held.items() if h != w.worker), default=0),
        )
        for w in live
    )
    decision = policy.choose(request, candidates)
    asked = Asked(policy, request, candidates)
    chosen = next(c for c in candidates if c.worker == decision.worker)
    if not can_pull(chosen.costs):
        return Choice(decision, asked)
    others = {w: n for w, n in held.items() if w != decision.worker}
    best = max(others, key=lambda w: (others[w], w), default=None)
    if best is None or others[best] <= decision.matched_blocks:
        return Choice(decision, asked)
    return Choice(decision, asked, best, others[best])


def role_of(state: WorkerState) -> str:
    """A worker's role (`router.pd.ROLES`): "mixed" until its info says otherwise."""
    return state.info.role if state.info is not None else MIXED


@dataclass(frozen=True)
class Placed:
    """Where a request goes, and the holder named to that worker (None: no pull to offer);
    for the policy's choice, what it was asked (`Placement.choose`: not recorded yet)."""

    decision: RouteDecision
    holder: HolderHint | None = None
    asked: Asked | None = None


class Placement:
    """Chooses a worker for a request, and the holder it may pull the prefix from."""

    def __init__(self, pool: WorkerPool, policy: Policy, config: RouterConfig) -> None:
        self.pool = pool
        self.policy = policy
        self.config = config
        self.affinity = AffinityTable()

    def candidates_left(self, excluded: set[WorkerId]) -> bool:
        return any(s.worker_id not in excluded for s in self.pool.routable())

    def route(
        self,
        num_tokens: int,
        hashes: list[BlockHash],
        excluded: set[WorkerId],
        roles: Collection[str] | None = None,
        affinity_key: str | None = None,
    ) -> Placed:
        """`choose`, recorded by the policy: the request runs where it chose. With an
        `affinity_key` (`affinity.scoped_key`), where that key's last request went while the
        policy finds that worker within its bounds (`prefix_aware` only); the key is noted
        wherever the request goes."""
        placed = self.choose(num_tokens, hashes, excluded, roles, affinity_key)
        assert placed.asked is not None
        placed.asked.record(placed.decision.worker)
        self.affinity.routed(affinity_key, placed.decision.worker)
        return placed

    def choose(
        self,
        num_tokens: int,
        hashes: list[BlockHash],
        excluded: set[WorkerId],
        roles: Collection[str] | None = None,
        affinity_key: str | None = None,
    ) -> Placed:
        """The policy's choice among the live workers not `excluded`, and the holder it may
        pull from (one index lookup for both), not recorded (`Placed.asked`). With `roles`,
        among the workers of those roles when there are any (a role is a preference: with
        none of them alive, any worker)."""
        live = [s for s in self.pool.routable() if s.worker_id not in excluded]
        if not live:
            raise Unavailable("no live worker to serve the request")
        if roles is not None:
            live = [s for s in live if role_of(s) in roles] or live
        limit = self.config.max_queued_per_worker
        if limit is not None:
            live = [s for s in live if s.num_requests < limit]
            if not live:
                raise Exhausted(f"every worker's queue is full ({limit} requests each)")
        matches = self.pool.index.longest_prefix(hashes)
        holders = self._holders(excluded) if self.config.peer_pull else {}
        loads = [
            LiveWorker(s.worker_id, s.num_requests, s.num_queued_tokens, s.load.block_costs)
            for s in live
        ]
        sticky = self.affinity.worker(affinity_key)
        block_size = self.pool.model.block_size
        request = RouteRequest(num_tokens, block_size, time.monotonic(), sticky)
        choice = choose(self.policy, request, loads, matches, holders)
        if choice.holder is None:
            return Placed(choice.decision, asked=choice.asked)
        hint = HolderHint(holders[choice.holder], choice.holder_blocks)
        return Placed(choice.decision, hint, choice.asked)

    def _holders(self, excluded: set[WorkerId]) -> dict[WorkerId, str]:
        """The healthy workers a peer may pull from, by their Ray actor names."""
        return {
            s.worker_id: s.info.actor_name
            for s in self.pool.healthy()
            if s.worker_id not in excluded and s.info is not None and s.info.actor_name
        }

    def covered_blocks(self, decision: RouteDecision, holder: HolderHint | None) -> int:
        """Leading blocks of the request the chosen worker will not compute: those it holds,
        or those it may pull from `holder` when it pulls at all (reports a pull cost)."""
        covered = decision.matched_blocks
        if holder is not None and can_pull(self.pool.state(decision.worker).load.block_costs):
            covered = max(covered, holder.num_blocks)
        return covered
