"""Prefill/decode roles in the simulator: where each request runs under a mode, decided by the
router's own functions (`router.policy.pd`) over the simulated workers' loads and costs.

Four modes over one cluster:

- `colocated`: every worker is mixed; the routing policy places the whole request (as without
  roles).
- `always`: the first `num_prefill` workers are prefill workers, the rest decode workers; the
  prompt runs on the prefill worker whose first token comes soonest (`fastest_prefill`),
  `pick_decode` chooses the decode worker.
- `decide`: the same roles; per request, `decide` weighs running it colocated on the policy's
  choice among the decode workers against computing its prompt on `fastest_prefill`'s prefill
  worker and decoding on `pick_decode`'s.
- `dynamic`: every worker is mixed; per request, `decide` weighs running it colocated on the
  policy's choice against computing its prompt where it stalls the fewest streams among the
  workers holding as much of it with no more queued (`pick_prefill`; the policy's choice when
  none is better) and decoding on `pick_decode`'s choice among the other workers.

As `router.request.disagg` sees them: a worker's uncached prompt tokens (the policy's match on the
colocated side, the prefix index's elsewhere), its queued tokens, its running streams, and its
per-token prefill and per-block pull costs from its reported `BlockCosts`. The policy is asked
once a request, for the colocated side, and records only where the request runs, as the
router's does (`router.policy.placement.Asked.record`): its choice when kept colocated, the decode
worker of a hand-off (pulling the prompt's full blocks), nothing when admission refuses it.

A disaggregated request runs twice: on its prefill worker up to its first token
(`SimSeq.prefill_only`, its TTFT), then on its decode worker (`handoff`), which pulls the
prompt's full blocks from the prefill worker (`SimLoads.plan_handoff`: the profile's pull cost,
the holder's staging), computes the tail (the last partial block and the first token) and
decodes the rest of the output. With `prefetch` (the router's `pd_prefetch`) that pull started
when the request was routed, each prefill step's blocks once it ended (`EarlyPull`). As the
router does, each request's answer is bounded by its `max_tokens` (a replay's client sets it to
the recorded answer, as benchmark clients replaying a trace do), each worker's recent prompt
work is kept (`PrefillShare`), and the hand-off's fixed cost is the router's `HandoffCost`,
learnt when a handed-off request ends whose pull brought every full block; the decode worker
evicts its copy of the prompt first once the request ends (`BlockPool.free(evict_first=)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cachesvc.kv.events import TIER_HBM
from cachesvc.kv.index import MemoryPrefixIndex, PrefixMatch
from cachesvc.kv.types import WorkerId
from cachesvc.sim.admit import SimAdmission
from cachesvc.sim.seq import EarlyPull, SimPeer, SimSeq
from cachesvc.sim.trace import SimRequest
from cachesvc.sim.worker import SimWorker
from router.policy.admission import predicted_ttft_s, queued_s, stalls_of
from router.policy.answers import Answer
from router.policy.costs import prefill_token_s
from router.policy.handoff_cost import HANDOFF_FIXED_PRIOR_S, HandoffCost
from router.policy.pd import (
    DECODE,
    MIXED,
    PREFILL,
    SERVING_ROLES,
    SLO,
    DecodeSide,
    PDDecision,
    PrefillSide,
    decide,
    with_answers,
)
from router.policy.pd_pick import (
    DecodeLoad,
    PrefillShare,
    fastest_prefill,
    pick_decode,
    pick_prefill,
)
from router.policy.placement import Choice, LiveWorker, choose
from router.policy.routing import PEER, Policy, RouteRequest

COLOCATED, ALWAYS, DECIDE, DYNAMIC = "colocated", "always", "decide", "dynamic"
PD_MODES = (COLOCATED, ALWAYS, DECIDE, DYNAMIC)
# Modes whose workers are all mixed: no roles.
MIXED_MODES = (COLOCATED, DYNAMIC)


def roles_for(mode: str, num_workers: int, num_prefill: int) -> list[str]:
    """Each worker's role under `mode`: all mixed colocated and dynamic, else `num_prefill`
    prefill workers then decode workers (a ValueError unless both kinds are there)."""
    if mode not in PD_MODES:
        raise ValueError(f"--pd must be one of {PD_MODES}, got {mode!r}")
    if mode in MIXED_MODES:
        return [MIXED] * num_workers
    if not 1 <= num_prefill < num_workers:
        raise ValueError(
            f"--pd {mode} needs 1 to {num_workers - 1} prefill workers of {num_workers}, "
            f"got {num_prefill}"
        )
    return [PREFILL] * num_prefill + [DECODE] * (num_workers - num_prefill)


@dataclass(frozen=True)
class Routed:
    """Where a request starts, and (disaggregated) the worker it decodes on afterwards."""

    worker: SimWorker
    seq: SimSeq
    reason: str
    decode: SimWorker | None = None


@dataclass(frozen=True)
class Refused:
    """A request admission refused (`router.policy.admission`): predicted to start too late."""

    reason: str


def colocated_ttft_s(req: SimRequest, worker: SimWorker, held_blocks: int) -> tuple[float, float]:
    """`req`'s predicted TTFT on `worker` holding `held_blocks` of its prompt, as
    `router.policy.pd.decide` predicts it colocated, and the part of it queued ahead (seconds)."""
    per_token, queued = _token_s(worker), worker.num_queued_tokens
    return predicted_ttft_s(queued, _uncached(req, held_blocks), per_token), queued * per_token


def choose_among(
    policy: Policy,
    req: SimRequest,
    workers: Sequence[SimWorker],
    matches: Mapping[WorkerId, PrefixMatch],
    holders: Sequence[WorkerId] = (),
) -> tuple[SimWorker, Choice]:
    """The policy's choice among `workers` (never empty), through `router.policy.placement.choose`;
    not recorded (`Choice.asked` records where the request runs)."""
    loads = [
        LiveWorker(w.worker_id, w.num_requests, w.num_queued_tokens, w.block_costs())
        for w in workers
    ]
    request = RouteRequest(req.prompt_len, req.block_size, req.arrival_s)
    choice = choose(policy, request, loads, matches, holders)
    return next(w for w in workers if w.worker_id == choice.decision.worker), choice


def joining(
    req: SimRequest,
    worker: SimWorker,
    choice: Choice | None,
    matches: Mapping[WorkerId, PrefixMatch],
    workers: Sequence[SimWorker],
    prefill_only: bool = False,
) -> SimSeq:
    """`req` as it joins `worker`: the device prefix the index says it holds there, and the
    holder the policy's `choice` of it named (any of `workers`; None: no choice of the
    policy's, as for a prompt computed on a prefill worker, and no holder named)."""
    match = matches.get(worker.worker_id)
    device = 0 if match is None else match.blocks_by_tier.get(TIER_HBM, 0)
    peer = None
    if choice is not None and choice.holder is not None:
        holder = next(w for w in workers if w.worker_id == choice.holder)
        peer = SimPeer(holder, choice.holder_blocks)
    return SimSeq(req, device, peer, prefill_only=prefill_only)


class PDRoutes:
    """Routes a cluster's requests under a mode with roles (`always` or `decide`) or over mixed
    workers (`dynamic`), and hands a disaggregated request from its prefill worker to its
    decode worker, as `router.request.disagg` plans them: the policy chooses the colocated worker
    once (`fastest_prefill` the prefill worker; `dynamic`: the prompt's worker by `pick_prefill`
    from the policy's choice; `pick_decode` the decode worker) and records where the request
    runs; `always` is `decide`'s plan with its verdict overridden; the hand-off's fixed cost is
    the router's `HandoffCost`, learnt as a handed-off request ends (the second token's wait
    less the part predicted from the request's size). Mutates the workers' queues only through
    the seqs it returns; keeps each request's `PDDecision`."""

    def __init__(
        self,
        mode: str,
        workers: Sequence[SimWorker],
        index: MemoryPrefixIndex,
        policy: Policy,
        stall_weight: float = 1.0,
        peer_pull: bool = False,
        slo: SLO | None = None,
        prefetch: bool = True,
        admission: SimAdmission | None = None,
    ) -> None:
        assert mode != COLOCATED, "colocated runs route as without roles"
        self.admission = admission or SimAdmission(None)
        self.prefetch = prefetch  # decode workers pull while the prefill runs
        self.mode = mode
        self.workers = workers
        self.index = index
        self.policy = policy
        # With the router's `peer_pull`, any worker may be named as the holder of a prefix.
        self.holders = [w.worker_id for w in workers] if peer_pull else []
        self.stall_weight = stall_weight
        self.dynamic = mode == DYNAMIC
        self.prefill_side = [w for w in workers if self.dynamic or w.role == PREFILL]
        self.decode_side = [w for w in workers if w.role in SERVING_ROLES]
        self.handoff_cost = HandoffCost(HANDOFF_FIXED_PRIOR_S)
        self.slo = slo  # the router's latency targets (`pd_ttft_slo_ms`, `pd_itl_slo_ms`)
        # Learnt from finished requests, as the router does; admission spreads stalls over it.
        self.mean_answer = self.admission.mean_answer
        self.shares = PrefillShare()  # each worker's recent prompt work, as the router's
        self.decisions: dict[int, PDDecision] = {}  # request index -> the decision
        self._decode_on: dict[int, SimWorker] = {}  # a prefill under way -> its decode worker

    def route(self, req: SimRequest) -> Routed | Refused | None:
        """Where `req` starts (None: no worker of a side could ever hold it; `Refused`:
        predicted to start later than the admission target, in the mode decided)."""
        prefill_side = [w for w in self.prefill_side if w.fits(req)]
        decode_side = [w for w in self.decode_side if w.fits(req)]
        if not prefill_side or not decode_side:
            return None
        matches = self.index.longest_prefix(req.hashes[: req.num_full_blocks])
        colocated, here = choose_among(self.policy, req, decode_side, matches, self.holders)
        now_s = req.arrival_s
        slo, weight = with_answers(self.slo, self.mean_answer.tokens, self.stall_weight)
        if self.dynamic:  # the prompt runs where it stalls least; the decode may go elsewhere
            prefill = _mixed_prefill(req, colocated, prefill_side, matches, weight)
            decode_side = [w for w in decode_side if w is not prefill] or [prefill]
        else:  # where its first token comes soonest
            sides = [_prefill_side(req, w, _held(matches, w), self.prefetch) for w in prefill_side]
            picked = fastest_prefill(sides).worker
            prefill = next(w for w in prefill_side if w.worker_id == picked)
        # The policy's match where the prompt runs on its choice, else the index's.
        there_blocks = _held(matches, prefill)
        if prefill is colocated:
            there_blocks = here.decision.matched_blocks
        shares = self.shares.shares(now_s, [w.worker_id for w in self.workers])
        loads = [_decode_load(w, shares[w.worker_id]) for w in decode_side]
        decode = next(w for w in decode_side if w.worker_id == pick_decode(loads))
        kept = _decode_side(req, colocated, here.decision.matched_blocks, shares)
        away = _decode_side(req, decode, _held(matches, decode), shares)
        there_side = _prefill_side(req, prefill, there_blocks, self.prefetch)
        decision = decide(
            req.prompt_len,
            req.block_size,
            kept,
            there_side,
            away,
            weight,
            self.handoff_cost.value(now_s),
            slo,
            Answer.of(req.output_len, self.mean_answer),
        )
        if self.mode == ALWAYS:
            decision = dataclasses.replace(decision, disaggregate=True, reason="always")
        stalls = stalls_of(decision, colocated, prefill, decode)
        refusal = self.admission.refusal(
            decision.predicted_ttft_s, queued_s(decision), stalls, now_s
        )
        if refusal is not None:  # it runs nowhere: the policy records nothing
            return Refused(refusal)
        self.decisions[req.index] = decision
        if not decision.disaggregate:
            here.asked.record(colocated.worker_id)
            self.shares.add(kept.worker, decision.prefill_s, now_s)
            seq = joining(req, colocated, here, matches, self.workers)
            self.admission.admitted(seq, decision.predicted_ttft_s)
            return Routed(colocated, seq, decision.reason)
        # A one-token answer is done when its prefill is: nothing to hand over.
        handed = req.output_len > 1
        if handed:  # its decode worker pulls the prompt's full blocks
            here.asked.record(decode.worker_id, req.num_full_blocks)
        else:
            here.asked.record(prefill.worker_id)
        self.shares.add(prefill.worker_id, decision.prefill_s, now_s)
        # The router names no holder to the prefill worker: it computes what it lacks.
        seq = joining(req, prefill, None, matches, self.workers, handed)
        self.admission.admitted(seq, decision.predicted_ttft_s)
        if seq.prefill_only:
            self._decode_on[req.index] = decode
        return Routed(prefill, seq, decision.reason, decode)

    def handoff(self, prefill: SimWorker, done: SimSeq) -> tuple[SimWorker, SimSeq] | None:
        """A request's prefill finished on `prefill` with its first token: its decode, joining
        its decode worker (None for anything else that finished: its answer is learnt, and a
        handed-off one's hand-off)."""
        if not done.prefill_only:
            times = done.token_times
            decode_s = times[-1] - times[0] if times else None
            self.mean_answer.observe(done.req.output_len, decode_s)
            if done.pulls_prompt:
                self._learn(done)
            return None
        decode = self._decode_on.pop(done.req.index)
        req = done.req
        early = None
        if self.prefetch:  # asked for a hop after the request was routed, at its arrival
            start_s = req.arrival_s + decode.profile.hop_s
            early = EarlyPull(start_s, tuple(done.chunk_times))
        seq = SimSeq(
            req,
            routed_blocks=req.num_full_blocks,  # what it pulls: its queued work is the tail
            peer=SimPeer(prefill, req.num_full_blocks),
            generated=1,
            first_token_s=done.first_token_s,
            pulls_prompt=True,
            token_times=list(done.token_times),
            early=early,
        )
        return decode, seq

    def _learn(self, done: SimSeq) -> None:
        """A handed-off request ended: its hand-off (the second token's wait less the part
        predicted from the request's size) is learnt when its pull brought every full block,
        as the router learns it (`Handoff.merged`), at the request's end."""
        req, times = done.req, done.token_times
        if len(times) < 2 or sum(done.cached.values()) < req.num_full_blocks * req.block_size:
            return
        decision = self.decisions[req.index]
        residual_s = times[1] - times[0] - (decision.handoff_s - decision.handoff_fixed_s)
        self.handoff_cost.observe(residual_s, times[-1])


def _mixed_prefill(
    req: SimRequest,
    colocated: SimWorker,
    workers: Sequence[SimWorker],
    matches: Mapping[WorkerId, PrefixMatch],
    stall_weight: float,
) -> SimWorker:
    """Between mixed workers, where the prompt runs if it is handed off (`pick_prefill`)."""
    sides = {w.worker_id: _prefill_side(req, w, _held(matches, w), False) for w in workers}
    chosen = pick_prefill(list(sides.values()), sides[colocated.worker_id], stall_weight)
    return next(w for w in workers if w.worker_id == chosen.worker)


def _held(matches: Mapping[WorkerId, PrefixMatch], worker: SimWorker) -> int:
    match = matches.get(worker.worker_id)
    return 0 if match is None else match.num_blocks


def _uncached(req: SimRequest, held_blocks: int) -> int:
    """Prompt tokens a worker holding `held_blocks` of the prompt computes."""
    return max(0, req.prompt_len - held_blocks * req.block_size)


def _token_s(worker: SimWorker) -> float:
    """Seconds of prefill per token, from the costs the worker reports, as the router reads
    them."""
    return prefill_token_s(worker.block_costs(), worker.block_size)


def _prefill_side(
    req: SimRequest, worker: SimWorker, held_blocks: int, prefetch: bool
) -> PrefillSide:
    # A prefill worker decodes nothing; a mixed one's runs decode unless they are handed off.
    streams = 0 if worker.role == PREFILL else sum(not s.prefill_only for s in worker.running)
    return PrefillSide(
        worker.worker_id,
        _uncached(req, held_blocks),
        worker.num_queued_tokens,
        _token_s(worker),
        streams,
        worker.profile.max_num_batched_tokens if prefetch else None,
    )


def _decode_side(
    req: SimRequest, worker: SimWorker, held_blocks: int, shares: Mapping[WorkerId, float]
) -> DecodeSide:
    costs = worker.block_costs()
    return DecodeSide(
        worker.worker_id,
        _uncached(req, held_blocks),
        worker.num_queued_tokens,
        len(worker.running),
        _token_s(worker),
        None if costs is None else costs.fetch_s.get(PEER),
        shares[worker.worker_id],
    )


def _decode_load(worker: SimWorker, prefill_share: float) -> DecodeLoad:
    return DecodeLoad(
        worker.worker_id,
        len(worker.running),
        len(worker.waiting),
        worker.pool.num_free,
        worker.num_queued_tokens,
        prefill_share,
    )
