"""Where a request goes: the live candidates as a policy sees them, its choice, and the holder
a chosen worker may pull the prefix from.

`Placement` turns the pool's state and the prefix index's matches into `Candidate`s (with, when
pulls are on, the longest prefix another healthy worker holds), asks the policy, and names that
holder to the chosen worker (`HolderHint`). Pure reads of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachesvc.types import BlockHash, WorkerId
from router.config import RouterConfig
from router.domain import Exhausted, Unavailable
from router.policy import PEER, Candidate, Policy, RouteDecision, RouteRequest
from router.pool import WorkerPool
from workers.protocol import HolderHint


@dataclass(frozen=True)
class Placed:
    """Where a request goes, and the holder named to that worker (None: no pull to offer)."""

    decision: RouteDecision
    holder: HolderHint | None = None


class Placement:
    """Chooses a worker for a request, and the holder it may pull the prefix from."""

    def __init__(self, pool: WorkerPool, policy: Policy, config: RouterConfig) -> None:
        self.pool = pool
        self.policy = policy
        self.config = config

    def candidates_left(self, excluded: set[WorkerId]) -> bool:
        return any(s.worker_id not in excluded for s in self.pool.routable())

    def route(self, num_tokens: int, hashes: list[BlockHash], excluded: set[WorkerId]) -> Placed:
        """The policy's choice among the live workers not `excluded`, and the holder it may
        pull from (one index lookup for both)."""
        live = [s for s in self.pool.routable() if s.worker_id not in excluded]
        if not live:
            raise Unavailable("no live worker to serve the request")
        limit = self.config.max_queued_per_worker
        if limit is not None:
            live = [s for s in live if s.num_requests < limit]
            if not live:
                raise Exhausted(f"every worker's queue is full ({limit} requests each)")
        matches = self.pool.index.longest_prefix(hashes)
        holders = self._holders(excluded) if self.config.peer_pull else {}
        held = {w: m.num_blocks for w, m in matches.items() if w in holders}
        candidates = [
            Candidate(
                s.worker_id,
                s.num_requests,
                s.num_queued_tokens,
                matches.get(s.worker_id),
                s.load.block_costs,
                max((n for w, n in held.items() if w != s.worker_id), default=0),
            )
            for s in live
        ]
        request = RouteRequest(num_tokens, self.pool.model.block_size)
        decision = self.policy.choose(request, candidates)
        return Placed(decision, _holder_hint(decision, held, holders))

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
        costs = self.pool.state(decision.worker).load.block_costs
        if holder is not None and costs is not None and PEER in costs.fetch_s:
            covered = max(covered, holder.num_blocks)
        return covered


def _holder_hint(
    decision: RouteDecision, held: dict[WorkerId, int], holders: dict[WorkerId, str]
) -> HolderHint | None:
    """The holder (other than the chosen worker) with the longest prefix, when it holds more
    than the chosen one: the chosen worker's load planner may pull the difference from it
    (`EngineConfig.peer_pull`). `held`: blocks each holder holds; empty with pulls off."""
    others = {w: n for w, n in held.items() if w != decision.worker}
    best = max(others, key=lambda w: (others[w], w), default=None)
    if best is None or others[best] <= decision.matched_blocks:
        return None
    return HolderHint(holders[best], others[best])
