"""Prefill/decode roles in the simulator: where each request runs under a mode, decided by the
router's own functions (`router.pd`) over the simulated workers' loads and costs.

Three modes over one cluster:

- `colocated`: every worker is mixed; the routing policy places the whole request (as without
  roles).
- `always`: the first `num_prefill` workers are prefill workers, the rest decode workers; the
  policy chooses the prefill worker among the prefill ones, `pick_decode` the decode worker.
- `decide`: the same roles; per request, `decide` weighs running it colocated on the policy's
  choice among the decode workers against computing its prompt on the policy's choice among
  the prefill workers and decoding on `pick_decode`'s.

As the router sees them: a worker's uncached prompt tokens from the prefix index (what it holds
of the prompt, up to the last token's block), its queued tokens, its running streams, and its
per-token prefill and per-block pull costs from its reported `BlockCosts`. One policy instance
chooses on each side (its memory of who was given what stays per pool); the colocated choice is
made, and remembered by that side's policy, even when the request is then disaggregated.

A disaggregated request runs twice: on its prefill worker up to its first token
(`SimSeq.prefill_only`, its TTFT), then on its decode worker (`handoff`), which pulls the
prompt's full blocks from the prefill worker (`SimLoads.plan_handoff`: the profile's pull cost,
the holder's staging), computes the tail (the last partial block and the first token) and
decodes the rest of the output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.events import TIER_HBM
from cachesvc.index import MemoryPrefixIndex, PrefixMatch
from cachesvc.sim.seq import SimPeer, SimSeq
from cachesvc.sim.trace import SimRequest
from cachesvc.sim.worker import SimWorker
from cachesvc.types import WorkerId
from router.pd import (
    DECODE,
    MIXED,
    PREFILL,
    DecodeLoad,
    DecodeSide,
    PDDecision,
    PrefillSide,
    decide,
    pick_decode,
)
from router.placement import Choice, LiveWorker, choose
from router.policy import PEER, Policy, RouteRequest, make_policy

COLOCATED, ALWAYS, DECIDE = "colocated", "always", "decide"
PD_MODES = (COLOCATED, ALWAYS, DECIDE)


def roles_for(mode: str, num_workers: int, num_prefill: int) -> list[str]:
    """Each worker's role under `mode`: all mixed colocated, else `num_prefill` prefill workers
    then decode workers (a ValueError unless both kinds are there)."""
    if mode not in PD_MODES:
        raise ValueError(f"--pd must be one of {PD_MODES}, got {mode!r}")
    if mode == COLOCATED:
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


def choose_among(
    policy: Policy,
    req: SimRequest,
    workers: Sequence[SimWorker],
    matches: Mapping[WorkerId, PrefixMatch],
    holders: Sequence[WorkerId] = (),
) -> tuple[SimWorker, Choice]:
    """The policy's choice among `workers` (never empty), through `router.placement.choose`."""
    loads = [
        LiveWorker(w.worker_id, w.num_requests, w.num_queued_tokens, w.block_costs())
        for w in workers
    ]
    request = RouteRequest(req.prompt_len, req.block_size, req.arrival_s)
    choice = choose(policy, request, loads, matches, holders)
    return next(w for w in workers if w.worker_id == choice.decision.worker), choice


def device_blocks(matches: Mapping[WorkerId, PrefixMatch], worker: SimWorker) -> int:
    """Blocks of the prompt the index says `worker` holds on its device."""
    match = matches.get(worker.worker_id)
    return 0 if match is None else match.blocks_by_tier.get(TIER_HBM, 0)


class PDRoutes:
    """Routes a cluster's requests under a mode with roles (`always` or `decide`), and hands a
    disaggregated request from its prefill worker to its decode worker. Mutates the workers'
    queues only through the seqs it returns; keeps each request's `PDDecision`."""

    def __init__(
        self,
        mode: str,
        workers: Sequence[SimWorker],
        index: MemoryPrefixIndex,
        policy: str,
        policy_options: Mapping[str, Any] | None = None,
        stall_weight: float = 1.0,
    ) -> None:
        assert mode in (ALWAYS, DECIDE), "colocated runs route as without roles"
        self.mode = mode
        self.index = index
        self.stall_weight = stall_weight
        self.prefill_side = [w for w in workers if w.role in (PREFILL, MIXED)]
        self.decode_side = [w for w in workers if w.role in (DECODE, MIXED)]
        self._prefill_policy = make_policy(policy, **(policy_options or {}))
        self._decode_policy = make_policy(policy, **(policy_options or {}))
        self.decisions: dict[int, PDDecision] = {}  # request index -> the decision
        self._decode_on: dict[int, SimWorker] = {}  # a prefill under way -> its decode worker
        # Per decode worker, the requests paired with it whose prefill is not done: waiting
        # there, as a live decode worker that is handed the request when it is routed counts
        # it (else a burst of arrivals would all pick the same idle decode worker).
        self._paired: Counter[WorkerId] = Counter()

    def route(self, req: SimRequest) -> Routed | None:
        """Where `req` starts (None: no worker of a side could ever hold it)."""
        prefill_side = [w for w in self.prefill_side if w.fits(req)]
        decode_side = [w for w in self.decode_side if w.fits(req)]
        if not prefill_side or not decode_side:
            return None
        matches = self.index.longest_prefix(req.hashes[: req.num_full_blocks])
        prefill, _ = choose_among(self._prefill_policy, req, prefill_side, matches)
        loads = [_decode_load(w, self._paired[w.worker_id]) for w in decode_side]
        decode = _by_id(decode_side, pick_decode(loads))
        colocated = decode
        if self.mode == ALWAYS:
            decision = PDDecision(True, "disaggregated: always")
        else:
            colocated, _ = choose_among(self._decode_policy, req, decode_side, matches)
            decision = decide(
                req.prompt_len,
                req.block_size,
                _decode_side(req, colocated, matches),
                _prefill_side(req, prefill, matches),
                _decode_side(req, decode, matches),
                self.stall_weight,
            )
        self.decisions[req.index] = decision
        if not decision.disaggregate:
            seq = SimSeq(req, device_blocks(matches, colocated))
            return Routed(colocated, seq, decision.reason)
        # A one-token answer is done when its prefill is: nothing to hand over.
        seq = SimSeq(req, device_blocks(matches, prefill), prefill_only=req.output_len > 1)
        if seq.prefill_only:
            self._decode_on[req.index] = decode
            self._paired[decode.worker_id] += 1
        return Routed(prefill, seq, decision.reason, decode)

    def handoff(self, prefill: SimWorker, done: SimSeq) -> tuple[SimWorker, SimSeq] | None:
        """A request's prefill finished on `prefill` with its first token: its decode, joining
        its decode worker (None for anything else that finished)."""
        if not done.prefill_only:
            return None
        decode = self._decode_on.pop(done.req.index)
        self._paired[decode.worker_id] -= 1
        req = done.req
        seq = SimSeq(
            req,
            routed_blocks=req.num_full_blocks,  # what it pulls: its queued work is the tail
            peer=SimPeer(prefill, req.num_full_blocks),
            generated=1,
            first_token_s=done.first_token_s,
            pulls_prompt=True,
            token_times=list(done.token_times),
        )
        return decode, seq


def _by_id(workers: Sequence[SimWorker], worker_id: WorkerId) -> SimWorker:
    return next(w for w in workers if w.worker_id == worker_id)


def _uncached(req: SimRequest, worker: SimWorker, matches: Mapping[WorkerId, PrefixMatch]) -> int:
    """Prompt tokens `worker` would compute: all but the prefix it holds, whose hit stops
    before the last token's block."""
    match = matches.get(worker.worker_id)
    held = 0 if match is None else min(match.num_blocks, req.max_match_blocks)
    return req.prompt_len - held * req.block_size


def _token_s(worker: SimWorker) -> float:
    """Seconds of prefill per token, from the costs the worker reports."""
    costs = worker.block_costs()
    assert costs is not None, "workers with roles report their costs (they pull)"
    return costs.compute_s / worker.block_size


def _prefill_side(
    req: SimRequest, worker: SimWorker, matches: Mapping[WorkerId, PrefixMatch]
) -> PrefillSide:
    return PrefillSide(
        worker.worker_id,
        _uncached(req, worker, matches),
        worker.num_queued_tokens,
        _token_s(worker),
    )


def _decode_side(
    req: SimRequest, worker: SimWorker, matches: Mapping[WorkerId, PrefixMatch]
) -> DecodeSide:
    costs = worker.block_costs()
    return DecodeSide(
        worker.worker_id,
        _uncached(req, worker, matches),
        worker.num_queued_tokens,
        len(worker.running),
        _token_s(worker),
        None if costs is None else costs.fetch_s.get(PEER),
    )


def _decode_load(worker: SimWorker, paired: int) -> DecodeLoad:
    return DecodeLoad(
        worker.worker_id,
        len(worker.running),
        len(worker.waiting) + paired,
        worker.pool.num_free,
        worker.num_queued_tokens,
    )
