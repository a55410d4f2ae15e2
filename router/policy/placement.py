"""Where a request goes, as a pure decision: the live candidates as a policy sees them, its
choice, and the holder a chosen worker may pull the prefix from.

`choose` is the one place that turns live workers' loads and the prefix index's matches into
`Candidate`s (with, when pulls are on, the longest prefix another holder has), asks the policy,
and names the holder to a chosen worker that pulls: the router (`router.request.placement`,
over its pool) and the simulator (`cachesvc.sim.loop`, over its simulated workers) both route
through it. It records nothing: what was asked (`Asked`) records, once known, the worker the
request runs on (the policy's choice, or the decode worker of a request handed off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.routing import Candidate, Policy, RouteDecision, RouteRequest, can_pull
from workers.protocol import BlockCosts


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
