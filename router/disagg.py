"""Prefill/decode disaggregation in the router: plan a request (colocated or handed off), run
its prefill on a prefill worker, then hand it to a decode worker that pulls the prompt's KV.

The hand-off reuses mid-stream failover (`router.resume`): the prefill worker runs the request
with `max_tokens=1`, so its one token is the request's first (streamed to the client at once:
the prefill worker's TTFT is the client's); the decode worker is then asked for the rest, with
the prompt plus that token as its prompt, `output_offset` 1 (seeded draws continue exactly) and
the prefill worker named as the holder of the prompt's blocks, which its load planner pulls over
the KV data plane (`workers/transfer/`) instead of computing them. Greedy and seeded streams are
token for token those of colocated serving.

Between mixed workers (`pd_mixed`, no prefill workers): the prompt runs on the policy's choice or
where it stalls fewer streams (`pick_prefill`), the decode may go to another (`pick_decode`), and
`decide` counts the prefill's stall on the prompt worker's own streams. Each worker's recent
prompt work (`PrefillShare`) is kept here.

Faults: a prefill worker that fails before its token is a request served colocated (the decode
side computes the prompt); one that fails after it is a pull that fails or times out on the
decode worker, which then computes the blocks itself; a decode worker that fails is a failover
as for any stream. Each sample of an `n`-sample request continues on the decode worker as its
own request, as after a failover; beam search (its beams are sent only when they finish) is
always colocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cachesvc.index import PrefixMatch
from cachesvc.types import BlockHash, WorkerId
from router.admission import Stall, stalls_of
from router.answers import Answer, MeanAnswer
from router.config import RouterConfig
from router.costs import PEER, prefill_token_s
from router.domain import Exhausted, Unavailable
from router.handoff import Handoff
from router.metrics import RequestOutcome, RouterMetrics
from router.pd import (
    DECODE,
    MIXED,
    PREFILL,
    SLO,
    DecodeSide,
    PDDecision,
    PrefillSide,
    decide,
    with_answers,
)
from router.pd_pick import DecodeLoad, PrefillShare, pick_decode, pick_prefill
from router.placement import Placed, Placement, role_of
from router.policy import RouteDecision
from router.pool import WorkerDied, WorkerPool
from router.prefetch import start_prefetch
from router.resume import Part, RequestProgress
from router.worker_state import WorkerState
from workers.protocol import HolderHint, StreamDelta, Usage

_log = logging.getLogger(__name__)

# Roles that serve whole requests (colocated) and decode handed-off ones.
SERVING_ROLES = frozenset({MIXED, DECODE})
# A hand-off's fixed cost before any is measured, and the weight of each measurement.
HANDOFF_FIXED_PRIOR_S = 0.02
_CALIBRATION_WEIGHT = 0.2

PartStream = Callable[..., AsyncGenerator[StreamDelta, None]]


@dataclass(frozen=True)
class _Seen:
    """What one plan reads of the cluster, once: each worker's cached match of the prompt and
    the share of its time it lately spent on prompts (healthy workers only)."""

    matches: Mapping[WorkerId, PrefixMatch]
    shares: Mapping[WorkerId, float]

    def held(self, worker: WorkerId) -> int:
        match = self.matches.get(worker)
        return 0 if match is None else match.num_blocks


class Disaggregation:
    """Plans each request and runs the prefill phase of the ones it hands off."""

    def __init__(
        self, pool: WorkerPool, placement: Placement, config: RouterConfig, metrics: RouterMetrics
    ) -> None:
        self.pool = pool
        self.placement = placement
        self.config = config
        self.metrics = metrics
        # What a hand-off costs whatever its size (a second call to a worker, a step on each
        # side), learnt from measured hand-offs; the prior is what one took on a CPU worker.
        self.handoff_fixed_s = HANDOFF_FIXED_PRIOR_S
        ttft, itl = config.pd_ttft_slo_ms, config.pd_itl_slo_ms
        self._slo = SLO(None if ttft is None else ttft / 1e3, None if itl is None else itl / 1e3)
        # The answers' mean length, over which the targets spread a stream's stall.
        self.mean_answer = MeanAnswer()
        # Each worker's recent prompt work: what a stream decoding there waits on.
        self.shares = PrefillShare()

    def answered(self, usage: Usage) -> None:
        """A request finished: its answer's length and decode time join their means."""
        decode_s = None
        if usage.decode_tokens_per_s and usage.completion_tokens > 1:
            decode_s = (usage.completion_tokens - 1) / usage.decode_tokens_per_s
        self.mean_answer.observe(usage.completion_tokens, decode_s)

    def _calibrate(self, measured_s: float, variable_s: float) -> None:
        residual = max(0.0, measured_s - variable_s)
        self.handoff_fixed_s += _CALIBRATION_WEIGHT * (residual - self.handoff_fixed_s)

    def active(self) -> bool:
        """Whether some healthy worker is a prefill worker (else nothing is disaggregated)."""
        return any(role_of(s) == PREFILL for s in self.pool.healthy())

    def serving_roles(self) -> frozenset[str] | None:
        """The roles a request is routed among when it is not handed off: decode and mixed
        workers while some are alive (None: no roles in this pool)."""
        return SERVING_ROLES if self.active() else None

    def mixed(self, excluded: set[WorkerId]) -> bool:
        """Whether requests may be handed off between mixed workers (`pd_mixed`): no prefill
        worker, and two or more healthy workers not `excluded`."""
        if not self.config.pd_mixed or self.active():
            return False
        return sum(s.worker_id not in excluded for s in self.pool.healthy()) >= 2

    def plan(
        self,
        progress: RequestProgress,
        hashes: list[BlockHash],
        excluded: set[WorkerId],
        admit: Callable[[PDDecision, list[Stall]], None] = lambda decision, stalls: None,
    ) -> Handoff | None:
        """Colocated or disaggregated for a request not started yet (None: no prefill workers
        and no hand-offs between mixed ones, or a request that cannot be handed off).
        `admit(decision, stalls)` may refuse it (raising) before it is counted anywhere; `stalls`
        are the workers whose streams it joins or stalls (`router.admission.stalls_of`)."""
        if self.config.pd_mode == "never" or not progress.resumable:
            return None
        mixed = self.mixed(excluded)
        if not mixed and not self.active():
            return None
        num_tokens = len(progress.prompt_ids)
        colocated = self.placement.route(num_tokens, hashes, excluded, SERVING_ROLES)
        max_tokens = progress.params.get("max_tokens")
        answer = Answer.of(None if max_tokens is None else int(max_tokens), self.mean_answer)
        now_s = time.monotonic()
        healthy = [s.worker_id for s in self.pool.healthy()]
        seen = _Seen(self.pool.index.longest_prefix(hashes), self.shares.shares(now_s, healthy))
        prefill: RouteDecision | None
        if mixed:  # the prompt runs where it stalls least; the decode may go to another
            prefill = self._mixed_prefill(num_tokens, seen, colocated.decision, excluded)
            decode = self._decode_choice(excluded | {prefill.worker}, seen)
        else:
            prefill = self._prefill_choice(num_tokens, hashes, excluded)
            decode = self._decode_choice(excluded, seen)
        decision = self._decide(num_tokens, seen, colocated, prefill, decode, answer)
        if self.config.pd_mode == "always" and prefill is not None and decode is not None:
            decision = dataclasses.replace(decision, disaggregate=True, reason="always")
        prefill_id = None if prefill is None else prefill.worker
        decode_id = None if decode is None else decode.worker_id
        admit(decision, stalls_of(decision, colocated.decision.worker, prefill_id, decode_id))
        self.metrics.pd_decisions.labels(decision.mode).inc()
        handoff = Handoff(decision, colocated, calibrate=self._calibrate)
        if not decision.disaggregate or prefill is None or decode is None:
            self.shares.add(colocated.decision.worker, decision.prefill_s, now_s)
            handoff._placed.append(colocated)
            return handoff
        self.shares.add(prefill.worker, decision.prefill_s, now_s)
        handoff.prefill, handoff.decode = prefill, decode.worker_id
        return handoff

    def _prefill_choice(
        self, num_tokens: int, hashes: list[BlockHash], excluded: set[WorkerId]
    ) -> RouteDecision | None:
        try:
            placed = self.placement.route(num_tokens, hashes, excluded, (PREFILL,))
        except (Unavailable, Exhausted):
            return None
        chosen = self.pool.state(placed.decision.worker)
        return placed.decision if role_of(chosen) == PREFILL else None

    def _mixed_prefill(
        self, num_tokens: int, seen: _Seen, chosen: RouteDecision, excluded: set[WorkerId]
    ) -> RouteDecision:
        """Between mixed workers, where the prompt runs if it is handed off: the policy's
        `chosen` worker, or one holding as much of it with no more queued where its prefill
        stalls fewer streams (`pick_prefill`)."""
        sides = [
            self._prefill_side(s, num_tokens, seen.held(s.worker_id))
            for s in self.pool.healthy()
            if s.worker_id not in excluded
        ]
        own = next((c for c in sides if c.worker == chosen.worker), None)
        if own is None:
            return chosen
        _, weight = with_answers(self._slo, self.mean_answer.tokens, self.config.pd_stall_weight)
        picked = pick_prefill(sides, own, weight)
        if picked.worker == chosen.worker:
            return chosen
        reason = "prefill where it stalls fewer streams than on the policy's choice"
        return RouteDecision(picked.worker, "pd", seen.held(picked.worker), None, reason)

    def _decode_choice(self, excluded: set[WorkerId], seen: _Seen) -> WorkerState | None:
        states = [
            s for s in self.pool.healthy() if s.worker_id not in excluded and role_of(s) != PREFILL
        ]
        if not states:
            return None
        loads = [
            DecodeLoad(
                s.worker_id,
                s.load.num_running,
                s.num_requests - s.load.num_running,
                _free_blocks(s),
                s.num_queued_tokens,
                seen.shares.get(s.worker_id, 0.0),
            )
            for s in states
        ]
        return self.pool.state(pick_decode(loads))

    def _decide(
        self,
        num_tokens: int,
        seen: _Seen,
        colocated: Placed,
        prefill: RouteDecision | None,
        decode: WorkerState | None,
        answer: Answer,
    ) -> PDDecision:
        block_size = self.pool.model.block_size
        at = self.pool.state(colocated.decision.worker)
        here = self._decode_side(at, num_tokens, colocated.decision.matched_blocks, seen)
        if prefill is None or decode is None:
            return decide(num_tokens, block_size, here, None)
        p = self.pool.state(prefill.worker)
        there = self._prefill_side(p, num_tokens, prefill.matched_blocks)
        away = here
        if decode.worker_id != at.worker_id:
            away = self._decode_side(decode, num_tokens, seen.held(decode.worker_id), seen)
        slo, weight = with_answers(self._slo, self.mean_answer.tokens, self.config.pd_stall_weight)
        fixed_s = self.handoff_fixed_s
        return decide(num_tokens, block_size, here, there, away, weight, fixed_s, slo, answer)

    def _prefill_side(self, state: WorkerState, num_tokens: int, held_blocks: int) -> PrefillSide:
        block_size = self.pool.model.block_size
        streams = 0 if role_of(state) == PREFILL else state.load.num_running  # a mixed worker's
        info = state.info  # its chunk: what an early pull moves before the token
        chunk = info.step_tokens if self.config.pd_prefetch and info is not None else None
        uncached = max(0, num_tokens - held_blocks * block_size)
        per_token = prefill_token_s(state.load.block_costs, block_size)
        return PrefillSide(
            state.worker_id, uncached, state.num_queued_tokens, per_token, streams, chunk
        )

    def _decode_side(
        self, state: WorkerState, num_tokens: int, matched_blocks: int, seen: _Seen
    ) -> DecodeSide:
        block_size = self.pool.model.block_size
        costs = state.load.block_costs
        pull_s = None if costs is None else costs.fetch_s.get(PEER)
        return DecodeSide(
            state.worker_id,
            max(0, num_tokens - matched_blocks * block_size),
            state.num_queued_tokens,
            state.load.num_running,
            prefill_token_s(costs, block_size),
            pull_s,
            seen.shares.get(state.worker_id, 0.0),
        )

    async def prefill(
        self,
        handoff: Handoff,
        progress: RequestProgress,
        request_id: str,
        outcome: RequestOutcome,
        part_stream: PartStream,
        record: Callable[[Usage], None],
        req: Any,
    ) -> AsyncGenerator[StreamDelta, None]:
        """The prefill phase of a planned request: nothing when it stays colocated, else the
        prefill worker's first token (its usage `record`ed when that token ends the request).
        Afterwards either the request has finished or `handoff.take()` places it: on the decode
        worker, pulling from the prefill worker, or colocated when the prefill worker failed
        before its token. `part_stream(decision, part, request_id, req, hold_kv=)` streams one
        part."""
        outcome.pd_mode = handoff.decision.mode
        outcome.pd_reason = handoff.decision.reason
        outcome.pd_predicted_ttft_ms = round(handoff.decision.predicted_ttft_s * 1e3, 2)
        if handoff.prefill is None or handoff.decode is None:
            return
        outcome.pd_predicted_handoff_ms = round(handoff.decision.handoff_s * 1e3, 2)
        # The decode worker counts the request from now, not from the hand-off: requests
        # arriving during this prefill see it and pair elsewhere when it is busier.
        decode = self.pool.state(handoff.decode)
        decode.num_inflight += 1
        prefetch = None
        if self.config.pd_prefetch and int(progress.params.get("max_tokens", 1)) > 1:
            prefetch = start_prefetch(
                decode,
                self.pool.state(handoff.prefill.worker),
                progress.prompt_ids,
                req.cache_salt,
                self.pool.model.block_size,
                handoff.decision.predicted_ttft_s,
                request_id,
            )
        try:
            async with contextlib.aclosing(
                self._prefill(handoff, progress, request_id, outcome, part_stream, record, req)
            ) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            decode.num_inflight -= 1
            if prefetch is not None and not handoff.handed_off:  # served colocated after all
                prefetch.cancel()

    async def _prefill(
        self,
        handoff: Handoff,
        progress: RequestProgress,
        request_id: str,
        outcome: RequestOutcome,
        part_stream: PartStream,
        record: Callable[[Usage], None],
        req: Any,
    ) -> AsyncGenerator[StreamDelta, None]:
        assert handoff.prefill is not None and handoff.decode is not None
        params = {**progress.params, "max_tokens": 1}
        part = Part(None, progress.prompt_ids, params)
        limit = int(progress.params.get("max_tokens", 1))
        # The prefill worker keeps the prompt's KV pinned for the decode worker's pull, when a
        # pull will follow (a one-token request ends there).
        hold = limit > 1
        stream = part_stream(handoff.prefill, part, f"{request_id}.prefill", req, hold_kv=hold)
        try:
            async for raw in stream:
                delta = raw
                if raw.usage is not None:
                    handoff.prefill_usage = raw.usage
                    if raw.finish_reason == "length" and limit > 1:  # ours, not the client's
                        # From here the router detokenizes: the worker flushed an unfinished
                        # character at its end, which the decode worker's tokens may finish.
                        progress.hand_off()
                        handoff.handed_off = True
                        delta = dataclasses.replace(raw, finish_reason=None, usage=None)
                forwarded = progress.forward(part, delta, handoff.prefill.worker)
                if forwarded is None:
                    continue
                if forwarded.usage is not None:  # the first token ended the request
                    record(forwarded.usage)
                if forwarded.token_ids:
                    handoff.first_token_s = time.perf_counter()
                if forwarded.token_ids or forwarded.text or forwarded.finish_reason:
                    yield forwarded
        except (WorkerDied, Exhausted) as exc:
            if not progress.started:
                self.metrics.pd_fallbacks.labels("prefill_failed").inc()
                _log.warning("prefill worker failed (%s); serving colocated", exc)
                fallback = handoff.colocated
                if fallback.decision.worker == handoff.prefill.worker:  # between mixed workers
                    fallback = Placed(RouteDecision(handoff.decode, "pd", reason="prefill failed"))
                handoff._placed.append(fallback)
                return
            # Its token reached the client: the decode worker continues, and its pull from the
            # failed worker fails or times out into a recompute.
            self.metrics.pd_fallbacks.labels("prefill_failed_after_token").inc()
        finally:
            await stream.aclose()
        if all(sample.finished for sample in progress.samples):
            return
        if not handoff.handed_off:  # the prefill worker failed after its token
            progress.hand_off()
            handoff.handed_off = True
        outcome.route_reason = handoff.decision.reason
        state = self.pool.state(handoff.prefill.worker)
        actor = state.info.actor_name if state.info is not None else None
        full_blocks = len(progress.prompt_ids) // self.pool.model.block_size
        holder = HolderHint(actor, full_blocks, handoff=True) if actor else None
        decision = RouteDecision(
            handoff.decode, "pd", 0, None, handoff.decision.reason, handoff.decision.pull_blocks
        )
        handoff._placed.append(Placed(decision, holder))


def _free_blocks(state: WorkerState) -> int:
    hbm = state.load.blocks.get("hbm")
    return 0 if hbm is None else hbm.total - hbm.used
