"""The router's admission at the door of one request (`Gate`): the pure rules of
`router.policy.admission` over the live pool's loads and its streams' measured gaps; a refusal
is `Exhausted` (RESOURCE_EXHAUSTED, HTTP 429), counted and logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from cachesvc.kv.types import WorkerId
from router.domain import Exhausted
from router.metrics import RequestOutcome
from router.policy.admission import (
    Admission,
    CalibratedAdmission,
    Stall,
    predicted_ttft_s,
    queued_s,
    streams_refusal,
)
from router.policy.answers import MeanAnswer
from router.policy.costs import prefill_token_s
from router.policy.pd import PDDecision
from router.policy.routing import RouteDecision
from router.policy.stream_gaps import RecentGaps
from router.pool.worker_pool import WorkerPool
from router.pool.worker_state import WorkerState


def worker_ttft_s(
    state: WorkerState, num_tokens: int, held_blocks: int, block_size: int
) -> tuple[float, float]:
    """A prompt of `num_tokens` on a live worker holding `held_blocks` of it: its predicted
    TTFT, and the part of it queued ahead of it (seconds)."""
    uncached = max(0, num_tokens - held_blocks * block_size)
    per_token = prefill_token_s(state.load.block_costs, block_size)
    queued = state.num_queued_tokens
    return predicted_ttft_s(queued, uncached, per_token), queued * per_token


class Gate:
    """The router's admission: `check` raises `Exhausted` (RESOURCE_EXHAUSTED, HTTP 429) for
    a request predicted to start later than `admit_ttft_ms`, or to join or stall streams that
    decode slower than `admit_itl_ms` (None: no such target), counts it in `refused` and puts
    the reason in its request log; `observe` learns the prediction's scale from each admitted
    request's first token, and each worker's inter-token gaps from its streams (`clock`)."""

    def __init__(
        self,
        pool: WorkerPool,
        admission: Admission,
        refused: Counter,
        mean_answer: MeanAnswer,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.now = now  # the clock gaps are timed on
        self.admission = CalibratedAdmission(admission)
        self.refused = refused
        self.mean_answer = mean_answer
        self.gaps: dict[WorkerId, RecentGaps] = {}

    def clock(self, worker: WorkerId) -> Callable[[int, int], None]:
        """For one stream on `worker`: call it with each delta's sample index and the number of
        tokens it brings; the gaps since that sample's previous ones join the worker's
        `RecentGaps` (with a streams' target only). Timed per sample: a stream of `n` samples
        gets `n` deltas a step, and its gaps are the steps', not a step's `n`th."""
        if self.admission.admission.itl_s is None:
            return lambda sample, num_tokens: None
        gaps = self.gaps.setdefault(worker, RecentGaps())
        last_s: dict[int, float] = {}  # each sample's previous tokens

        def tick(sample: int, num_tokens: int) -> None:
            if num_tokens:
                now_s = self.now()
                if sample in last_s:
                    gaps.observe(now_s, now_s - last_s[sample], num_tokens)
                last_s[sample] = now_s

        return tick

    def check(
        self, predicted_s: float, queued_s: float, stalls: Sequence[Stall], outcome: RequestOutcome
    ) -> None:
        """Refuse a request predicted (raw) to get its first token in `predicted_s` seconds
        (`queued_s` of them behind other work), when that is too late, or that would join or
        stall (`stalls`) streams already too slow; else remember the prediction to learn
        from."""
        if not self.admission.on:
            return
        scaled_s = self.admission.scaled(predicted_s)
        if self.admission.admission.ttft_s is not None:
            outcome.admit_predicted_ttft_ms = round(scaled_s * 1e3, 2)
        refusal = self.admission.admission.refusal(scaled_s, queued_s) or self._streams(stalls)
        if refusal is not None:
            self.refused.inc()
            outcome.route_reason = refusal
            raise Exhausted(refusal)
        outcome.admit_predicted_s = predicted_s

    def _streams(self, stalls: Sequence[Stall]) -> str | None:
        now_s = self.now()
        touched = (
            (worker, gaps.mean_s(now_s), stall_s, self.pool.state(worker).num_requests)
            for worker, stall_s in stalls
            if (gaps := self.gaps.get(worker)) is not None
        )
        return streams_refusal(self.admission.admission, touched, self.mean_answer.tokens)

    def check_placed(
        self, decision: RouteDecision, num_tokens: int, outcome: RequestOutcome
    ) -> None:
        """`check` a prompt of `num_tokens` placed as `decision` says (its worker, the blocks it
        holds)."""
        if not self.admission.on:
            return
        state, block_size = self.pool.state(decision.worker), self.pool.model.block_size
        predicted, queued = worker_ttft_s(state, num_tokens, decision.matched_blocks, block_size)
        prefill_s = predicted - queued  # the prompt's own compute, which its streams lose
        self.check(predicted, queued, [(decision.worker, prefill_s)], outcome)

    def check_planned(
        self, decision: PDDecision, stalls: Sequence[Stall], outcome: RequestOutcome
    ) -> None:
        """`check` a request as the P/D plan placed it (handed off: on its prefill worker)."""
        self.check(decision.predicted_ttft_s, queued_s(decision), stalls, outcome)

    def observe(self, outcome: RequestOutcome) -> None:
        """The request's first token came: its TTFT against its prediction."""
        predicted = outcome.admit_predicted_s
        if predicted is not None and outcome.ttft_s is not None:
            self.admission.scale.observe(predicted, outcome.ttft_s)
