"""Prefill/decode disaggregation in the router: plan a request (colocated or handed off), run
its prefill on a prefill worker, then hand it to a decode worker that pulls the prompt's KV.

The hand-off reuses mid-stream failover (`router.request.resume`): the prefill worker runs the
request with `max_tokens=1`, so its one token is the request's first (streamed to the client at
once: the prefill worker's TTFT is the client's); the decode worker is then asked for the rest, with
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

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cachesvc.kv.types import BlockHash, WorkerId
from router.config import RouterConfig
from router.domain import Exhausted
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.admission import Stall, stalls_of
from router.policy.answers import Answer, MeanAnswer
from router.policy.handoff_cost import HANDOFF_FIXED_PRIOR_S, HandoffCost
from router.policy.pd import PREFILL, SERVING_ROLES, SLO, PDDecision, decide, with_answers
from router.policy.pd_pick import PrefillShare, fastest_prefill, pick_decode, pick_prefill
from router.policy.routing import RouteDecision
from router.pool.worker_errors import WorkerDied
from router.pool.worker_pool import WorkerPool
from router.pool.worker_state import WorkerState
from router.request.handoff import Handoff
from router.request.pd_sides import Seen, decode_load, decode_side, prefill_side
from router.request.placement import Placed, Placement, role_of
from router.request.prefetch import start_prefetch
from router.request.resume import Part, RequestProgress
from workers.protocol import HolderHint, StreamDelta, Usage

_log = logging.getLogger(__name__)


PartStream = Callable[..., AsyncGenerator[StreamDelta, None]]


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
        self.handoff_cost = HandoffCost(HANDOFF_FIXED_PRIOR_S)
        self._releases: set[asyncio.Task[None]] = set()  # holds being let go on prefill workers
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
        are the workers whose streams it joins or stalls (`router.policy.admission.stalls_of`). The
        policy is asked once and told only where the request runs (`Asked.record`): its own
        choice kept colocated, a hand-off's decode worker, or the prefill worker that the
        first token ends it on; nothing when refused."""
        if self.config.pd_mode == "never" or not progress.resumable:
            return None
        mixed = self.mixed(excluded)
        if not mixed and not self.active():
            return None
        num_tokens = len(progress.prompt_ids)
        # The policy's choice, not recorded: it is told where the request runs once decided.
        colocated = self.placement.choose(num_tokens, hashes, excluded, SERVING_ROLES)
        room = self._room(progress)
        answer = Answer.of(room, self.mean_answer)
        now_s = time.monotonic()
        healthy = [s.worker_id for s in self.pool.healthy()]
        seen = Seen(self.pool.index.longest_prefix(hashes), self.shares.shares(now_s, healthy))
        prefill: RouteDecision | None
        if mixed:  # the prompt runs where it stalls least; the decode may go to another
            prefill = self._mixed_prefill(num_tokens, seen, colocated.decision, excluded)
            decode = self._decode_choice(excluded | {prefill.worker}, seen)
        else:
            prefill = self._prefill_choice(num_tokens, seen, excluded)
            decode = self._decode_choice(excluded, seen)
        decision = self._decide(num_tokens, seen, colocated, prefill, decode, answer, now_s)
        if self.config.pd_mode == "always" and prefill is not None and decode is not None:
            decision = dataclasses.replace(decision, disaggregate=True, reason="always")
        prefill_id = None if prefill is None else prefill.worker
        decode_id = None if decode is None else decode.worker_id
        admit(decision, stalls_of(decision, colocated.decision.worker, prefill_id, decode_id))
        self.metrics.pd_decisions.labels(decision.mode).inc()
        handoff = Handoff(decision, colocated, cost=self.handoff_cost)
        assert colocated.asked is not None
        if not decision.disaggregate or prefill is None or decode is None:
            colocated.asked.record(colocated.decision.worker)
            self.shares.add(colocated.decision.worker, decision.prefill_s, now_s)
            handoff._placed.append(colocated)
            return handoff
        full_blocks = num_tokens // self.pool.model.block_size
        if room > 1:  # the decode worker pulls the prompt's full blocks and decodes the rest
            colocated.asked.record(decode.worker_id, full_blocks)
        else:  # the first token ends it: it runs on the prefill worker alone
            colocated.asked.record(prefill.worker)
        self.shares.add(prefill.worker, decision.prefill_s, now_s)
        handoff.prefill, handoff.decode = prefill, decode.worker_id
        handoff.full_tokens = full_blocks * self.pool.model.block_size
        return handoff

    def _room(self, progress: RequestProgress) -> int:
        """Tokens the answer may have: its `max_tokens`, or fewer where the model's context
        ends first (the prompt and one token fill it: the first token ends the request)."""
        max_tokens = int(progress.params.get("max_tokens", 1))
        return min(max_tokens, self.pool.model.max_model_len - len(progress.prompt_ids))

    def _prefill_choice(
        self, num_tokens: int, seen: Seen, excluded: set[WorkerId]
    ) -> RouteDecision | None:
        """The prefill worker where the prompt's first token comes soonest (`fastest_prefill`:
        its queue and what it does not hold of the prompt); None without one. Not the policy's
        choice: the policy is asked once, for the colocated side."""
        limit = self.config.max_queued_per_worker
        block_size, prefetch = self.pool.model.block_size, self.config.pd_prefetch
        sides = [
            prefill_side(s, num_tokens, seen.held(s.worker_id), block_size, prefetch)
            for s in self.pool.healthy()
            if s.worker_id not in excluded
            and role_of(s) == PREFILL
            and (limit is None or s.num_requests < limit)
        ]
        if not sides:
            return None
        picked = fastest_prefill(sides)
        held = seen.held(picked.worker)
        return RouteDecision(picked.worker, "pd", held, None, "first token soonest")

    def _mixed_prefill(
        self, num_tokens: int, seen: Seen, chosen: RouteDecision, excluded: set[WorkerId]
    ) -> RouteDecision:
        """Between mixed workers, where the prompt runs if it is handed off: the policy's
        `chosen` worker, or one holding as much of it with no more queued where its prefill
        stalls fewer streams (`pick_prefill`)."""
        block_size, prefetch = self.pool.model.block_size, self.config.pd_prefetch
        sides = [
            prefill_side(s, num_tokens, seen.held(s.worker_id), block_size, prefetch)
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

    def _decode_choice(self, excluded: set[WorkerId], seen: Seen) -> WorkerState | None:
        states = [
            s for s in self.pool.healthy() if s.worker_id not in excluded and role_of(s) != PREFILL
        ]
        if not states:
            return None
        loads = [decode_load(s, seen) for s in states]
        return self.pool.state(pick_decode(loads))

    def _decide(
        self,
        num_tokens: int,
        seen: Seen,
        colocated: Placed,
        prefill: RouteDecision | None,
        decode: WorkerState | None,
        answer: Answer,
        now_s: float,
    ) -> PDDecision:
        block_size = self.pool.model.block_size
        at = self.pool.state(colocated.decision.worker)
        here = decode_side(at, num_tokens, colocated.decision.matched_blocks, block_size, seen)
        if prefill is None or decode is None:
            return decide(num_tokens, block_size, here, None)
        p = self.pool.state(prefill.worker)
        prefetch = self.config.pd_prefetch
        there = prefill_side(p, num_tokens, prefill.matched_blocks, block_size, prefetch)
        away = here
        if decode.worker_id != at.worker_id:
            held = seen.held(decode.worker_id)
            away = decode_side(decode, num_tokens, held, block_size, seen)
        slo, weight = with_answers(self._slo, self.mean_answer.tokens, self.config.pd_stall_weight)
        fixed_s = self.handoff_cost.value(now_s)
        return decide(num_tokens, block_size, here, there, away, weight, fixed_s, slo, answer)

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
        try:
            if self.config.pd_prefetch and self._room(progress) > 1:
                prefetch = start_prefetch(
                    decode,
                    self.pool.state(handoff.prefill.worker),
                    progress.prompt_ids,
                    req.cache_salt,
                    self.pool.model.block_size,
                    handoff.decision.predicted_ttft_s,
                    request_id,
                )
            async with contextlib.aclosing(
                self._prefill(handoff, progress, request_id, outcome, part_stream, record, req)
            ) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            decode.num_inflight -= 1
            if not handoff.handed_off:  # ended here, or served colocated after all: no pull
                handoff.let_go()
                if prefetch is not None:
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
        limit = self._room(progress)
        # The prefill worker keeps the prompt's KV pinned for the decode worker's pull, when a
        # pull will follow (a one-token answer, or one the context ends, ends there), until the
        # router lets go of it (`Handoff.let_go`).
        hold = limit > 1
        if hold:
            handoff.release = functools.partial(
                self._let_go, handoff.prefill.worker, progress.prompt_ids, req.cache_salt
            )
        stream = part_stream(handoff.prefill, part, f"{request_id}.prefill", req, hold_kv=hold)
        try:
            async for raw in stream:
                delta = raw
                if raw.usage is not None:
                    handoff.prefill_usage = raw.usage
                    if raw.finish_reason == "length" and hold:  # ours, not the client's
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

    def _let_go(self, worker: WorkerId, prompt_ids: list[int], cache_salt: str | None) -> None:
        """Tell `worker` to unpin the prompt it keeps for a pull that is over or will not come,
        in the background (nobody waits for it)."""
        task = asyncio.get_running_loop().create_task(
            self._release_hold(worker, prompt_ids, cache_salt)
        )
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_hold(
        self, worker: WorkerId, prompt_ids: list[int], cache_salt: str | None
    ) -> None:
        try:
            await self.pool.call(worker, "release_hold", prompt_ids, cache_salt)
        except Exception as exc:  # gone (its pins with it), or an older build: the pins expire
            _log.debug("releasing a hold on %s failed: %s", worker, exc)
