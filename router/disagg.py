"""Prefill/decode disaggregation in the router: plan a request (colocated or handed off), run
its prefill on a prefill worker, then hand it to a decode worker that pulls the prompt's KV.

The hand-off reuses mid-stream failover (`router.resume`): the prefill worker runs the request
with `max_tokens=1`, so its one token is the request's first (streamed to the client at once:
the prefill worker's TTFT is the client's); the decode worker is then asked for the rest, with
the prompt plus that token as its prompt, `output_offset` 1 (seeded draws continue exactly) and
the prefill worker named as the holder of the prompt's blocks, which its load planner pulls over
the KV data plane (`workers/transfer/`) instead of computing them. Greedy and seeded streams are
token for token those of colocated serving.

Between mixed workers (`pd_mixed`, no prefill workers): the prompt runs on the worker the policy
chose, as colocated, and the decode may go to another (`pick_decode`'s among the rest); the
prefill then stalls the prompt worker's own streams either way, which `decide` counts.

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
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from cachesvc.types import BlockHash, WorkerId
from router.config import RouterConfig
from router.costs import PEER
from router.domain import Exhausted, Unavailable
from router.metrics import RequestOutcome, RouterMetrics
from router.pd import (
    DECODE,
    MIXED,
    PREFILL,
    SLO,
    DecodeLoad,
    DecodeSide,
    MeanAnswer,
    PDDecision,
    PrefillSide,
    decide,
    pick_decode,
    with_answers,
)
from router.placement import Placed, Placement, role_of
from router.policy import RouteDecision
from router.pool import WorkerDied, WorkerPool
from router.prefetch import start_prefetch
from router.resume import Part, RequestProgress
from router.worker_state import WorkerState
from workers.protocol import PEER_TOKENS, HolderHint, StreamDelta, Usage

_log = logging.getLogger(__name__)

# Roles that serve whole requests (colocated) and decode handed-off ones.
SERVING_ROLES = frozenset({MIXED, DECODE})
# A hand-off's fixed cost before any is measured, and the weight of each measurement.
HANDOFF_FIXED_PRIOR_S = 0.02
_CALIBRATION_WEIGHT = 0.2

PartStream = Callable[..., AsyncGenerator[StreamDelta, None]]


@dataclass
class Handoff:
    """One request's plan, and what its prefill phase brought back; mutated by the router."""

    decision: PDDecision
    colocated: Placed
    prefill: RouteDecision | None = None
    decode: WorkerId | None = None
    prefill_usage: Usage | None = None
    handed_off: bool = False
    first_token_s: float | None = None  # when the prefill worker's token reached the client
    # Told each measured hand-off (seconds) with the part of the prediction that scales with
    # the request (seconds), to learn the fixed part.
    calibrate: Callable[[float, float], None] | None = None
    _placed: list[Placed] = field(default_factory=list)

    def take(self) -> Placed | None:
        """The placement of the first attempt after planning (None afterwards: route anew)."""
        return self._placed.pop() if self._placed else None

    def observe(self, delta: StreamDelta, metrics: RouterMetrics, outcome: RequestOutcome) -> None:
        """Time the hand-off at the decode worker's first delta (once): measured against
        predicted, in the metrics and the request's log line."""
        if not self.handed_off or self.first_token_s is None or outcome.pd_handoff_ms is not None:
            return
        measured_s = time.perf_counter() - self.first_token_s
        outcome.pd_handoff_ms = round(measured_s * 1e3, 2)
        predicted_s = self.decision.handoff_s
        if predicted_s > 0:
            metrics.pd_error.labels("handoff").observe(measured_s / predicted_s)
        if self.calibrate is not None:
            self.calibrate(measured_s, predicted_s - self.decision.handoff_fixed_s)

    def merged(self, delta: StreamDelta) -> StreamDelta:
        """The decode worker's last delta with the whole request's usage: the prompt's cached
        and computed tokens as the prefill worker counted them (the decode worker's tail
        added), and the KV it pulled."""
        if not self.handed_off or delta.usage is None or self.prefill_usage is None:
            return delta
        first, last = self.prefill_usage, delta.usage
        usage = dataclasses.replace(
            last,
            cached_tokens=dict(first.cached_tokens),
            computed_tokens=first.computed_tokens + last.computed_tokens,
            ttft_ms=first.ttft_ms,
            lossy_kv=first.lossy_kv or last.lossy_kv,
            prefill_worker_id=first.worker_id,
            kv_transfer_tokens=last.cached_tokens.get(PEER_TOKENS, 0),
        )
        return dataclasses.replace(delta, usage=usage)


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

    def answered(self, num_tokens: int) -> None:
        """A request finished with `num_tokens` output tokens (its mean answer's share)."""
        self.mean_answer.observe(num_tokens)

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
        self, progress: RequestProgress, hashes: list[BlockHash], excluded: set[WorkerId]
    ) -> Handoff | None:
        """Colocated or disaggregated for a request not started yet (None: no prefill workers
        and no hand-offs between mixed ones, or a request that cannot be handed off)."""
        if self.config.pd_mode == "never" or not progress.resumable:
            return None
        mixed = self.mixed(excluded)
        if not mixed and not self.active():
            return None
        num_tokens = len(progress.prompt_ids)
        colocated = self.placement.route(num_tokens, hashes, excluded, SERVING_ROLES)
        if mixed:  # the prompt runs where the policy chose; the decode may go to another
            prefill: RouteDecision | None = colocated.decision
            decode = self._decode_choice(excluded | {colocated.decision.worker})
        else:
            prefill = self._prefill_choice(num_tokens, hashes, excluded)
            decode = self._decode_choice(excluded)
        decision = self._decide(num_tokens, hashes, colocated, prefill, decode)
        if self.config.pd_mode == "always" and prefill is not None and decode is not None:
            decision = dataclasses.replace(decision, disaggregate=True, reason="always")
        self.metrics.pd_decisions.labels(decision.mode).inc()
        handoff = Handoff(decision, colocated, calibrate=self._calibrate)
        if not decision.disaggregate or prefill is None or decode is None:
            handoff._placed.append(colocated)
            return handoff
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

    def _decode_choice(self, excluded: set[WorkerId]) -> WorkerState | None:
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
            )
            for s in states
        ]
        return self.pool.state(pick_decode(loads))

    def _decide(
        self,
        num_tokens: int,
        hashes: list[BlockHash],
        colocated: Placed,
        prefill: RouteDecision | None,
        decode: WorkerState | None,
    ) -> PDDecision:
        block_size = self.pool.model.block_size
        at = self.pool.state(colocated.decision.worker)
        here = self._decode_side(at, num_tokens, colocated.decision.matched_blocks)
        if prefill is None or decode is None:
            return decide(num_tokens, block_size, here, None)
        p = self.pool.state(prefill.worker)
        uncached = max(0, num_tokens - prefill.matched_blocks * block_size)
        streams = 0 if role_of(p) == PREFILL else p.load.num_running  # a mixed worker's
        # With the pull while the prefill runs, its chunk says how much moves before the token.
        chunk = p.info.step_tokens if self.config.pd_prefetch and p.info is not None else None
        there = PrefillSide(
            p.worker_id, uncached, p.num_queued_tokens, _token_s(p, block_size), streams, chunk
        )
        away = here
        if decode.worker_id != at.worker_id:
            held = self.pool.index.longest_prefix(hashes).get(decode.worker_id)
            away = self._decode_side(decode, num_tokens, 0 if held is None else held.num_blocks)
        slo, weight = with_answers(self._slo, self.mean_answer.tokens, self.config.pd_stall_weight)
        return decide(num_tokens, block_size, here, there, away, weight, self.handoff_fixed_s, slo)

    def _decode_side(self, state: WorkerState, num_tokens: int, matched_blocks: int) -> DecodeSide:
        block_size = self.pool.model.block_size
        costs = state.load.block_costs
        pull_s = None if costs is None else costs.fetch_s.get(PEER)
        return DecodeSide(
            state.worker_id,
            max(0, num_tokens - matched_blocks * block_size),
            state.num_queued_tokens,
            state.load.num_running,
            _token_s(state, block_size),
            pull_s,
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
        holder = HolderHint(actor, full_blocks) if actor else None
        decision = RouteDecision(
            handoff.decode, "pd", 0, None, handoff.decision.reason, handoff.decision.pull_blocks
        )
        handoff._placed.append(Placed(decision, holder))


def _token_s(state: WorkerState, block_size: int) -> float:
    """A worker's seconds of prefill per token, from its calibrated costs (an H100's for an 8B
    model when it reports none: `router.costs.UNREPORTED_S_PER_TOKEN`)."""
    from router.costs import UNREPORTED_S_PER_TOKEN

    costs = state.load.block_costs
    if costs is None or costs.compute_s <= 0:
        return UNREPORTED_S_PER_TOKEN
    return costs.compute_s / block_size


def _free_blocks(state: WorkerState) -> int:
    hbm = state.load.blocks.get("hbm")
    return 0 if hbm is None else hbm.total - hbm.used
