"""A request placed over the live pool (`Placement`): its workers' loads and the prefix index's
matches read from the pool, the pure choice (`router.policy.placement.choose`) asked, the worker
and the holder it may pull from (`Placed`). Pure reads of the pool.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from cachesvc.kv.types import BlockHash, WorkerId
from router.config import RouterConfig
from router.domain import Exhausted, Unavailable
from router.policy.pd import MIXED
from router.policy.placement import Asked, LiveWorker, choose
from router.policy.routing import Policy, RouteDecision, RouteRequest, can_pull
from router.pool.worker_pool import WorkerPool
from router.pool.worker_state import WorkerState
from router.request.affinity import AffinityTable
from workers.protocol import HolderHint


def role_of(state: WorkerState) -> str:
    """A worker's role (`router.policy.pd.ROLES`): "mixed" until its info says otherwise."""
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
