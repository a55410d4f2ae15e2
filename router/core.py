"""What the router decides: tokenize, hash, look up, choose, forward, retry.

Takes and returns the router's own types (`router.domain`, `workers.protocol` messages); the gRPC
edge (`server.py`) translates. Block hashes are computed exactly as the workers compute them
(same fingerprint, block size and salt), so the routing key is the storage key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import asdict, fields

from cachesvc.kv.types import BlockHash, WorkerId
from router.admin import (
    close_session,
    flush_workers,
    purge,
    push_quotas,
    tenant_usage,
    worker_statuses,
)
from router.config import RouterConfig
from router.domain import (
    Exhausted,
    GenerateInput,
    PrewarmInput,
    PrewarmResult,
    PromptInput,
    RouterError,
    RouterStats,
    ScoreInput,
    ScoreResult,
    TenantUsage,
    Unavailable,
    WorkerStatus,
)
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.admission import admission_of
from router.policy.routing import Policy, RouteDecision
from router.pool.supervisor import Replace, Supervisor
from router.pool.worker_errors import WorkerDied
from router.pool.worker_pool import WorkerPool
from router.request.affinity import scoped_key
from router.request.cache_hints import cache_hints, check_retention
from router.request.disagg import Disaggregation
from router.request.explain import block_misses, explained, unexplained
from router.request.gate import Gate
from router.request.handoff import Handoff
from router.request.placement import Placement
from router.request.prewarm import prewarm_request, prewarm_result
from router.request.prompts import Prompts
from router.request.resume import Part, RequestProgress
from router.request.scoring import score as run_score
from router.request.streams import merged
from router.response_cache.cache import (
    EntryShape,
    ResponseCollector,
    is_deterministic,
    make_response_cache,
    num_samples,
    response_key,
)
from router.tenants import QuotaTable, TenantLimits
from workers.protocol import HolderHint, StreamDelta, Usage
from workers.text.tokenizer import Tokenizer

_log = logging.getLogger(__name__)


class Router:
    """Routes requests over a started `WorkerPool`; one per process."""

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer: Tokenizer | None,
        policy: Policy,
        config: RouterConfig,
        replace: Replace | None = None,
    ) -> None:
        """`replace` starts a new actor for a worker that is dead for good (None: a dead
        worker stays dead, e.g. for a router attached to another's workers)."""
        self.pool = pool
        self.tokenizer = tokenizer
        self.policy = policy
        self.config = config
        self._stats = RouterStats(policy.name)
        self.metrics = RouterMetrics()
        self.metrics.watch(pool)
        self.prompts = Prompts(pool, tokenizer)
        self.responses = make_response_cache(config)
        if self.responses is not None:
            self.metrics.watch_response_cache(self.responses.stats)
        self.supervisor = Supervisor(pool, config, replace)
        self.placement = Placement(pool, policy, config)
        self.pd = Disaggregation(pool, self.placement, config, self.metrics)
        self.admission = Gate(pool, admission_of(config), self.metrics.refused, self.pd.mean_answer)
        self.quotas = QuotaTable.of_tokens(config.tenant_tokens)
        pool.quotas = self.quotas.for_workers()  # given to each worker as it joins

    async def start(self) -> None:
        """Wait for the workers, index what they hold and start supervising them."""
        model = await self.pool.start()
        self.supervisor.start()
        self.prompts.start()
        self._stats.block_size = model.block_size
        self._stats.model_fingerprint = model.model_fingerprint

    async def close(self) -> None:
        await self.supervisor.close()
        await self.pool.close()
        self.prompts.close()
        if self.responses is not None:
            await self.responses.close()

    async def tokenize(
        self, prompt: PromptInput, continuation: bool = False
    ) -> tuple[list[int], int, str]:
        """Token ids, the number of full blocks they make, and the text they came from."""
        return await self.prompts.tokenize(prompt, continuation)

    # ---- generate ---------------------------------------------------------------------------

    async def generate(self, req: GenerateInput) -> AsyncGenerator[StreamDelta, None]:
        """Stream deltas from the worker chosen for the request. A worker that dies (or is
        full) before sending anything is replaced; one that dies mid-stream is resumed on
        another (see `router.request.resume`), so the client sees one stream."""
        if self._stats.num_inflight >= self.config.max_inflight:
            raise Exhausted(f"router is at its limit of {self.config.max_inflight} requests")
        check_retention(self.quotas, req.tenant, req.retention_s)
        # The salt takes the purge epoch now, once: the request keeps its hashes to its end.
        req = dataclasses.replace(req, cache_salt=self.prompts.salt(req.cache_salt))
        ids = await self.prompts.encode(req.prompt)
        req = dataclasses.replace(req, params=self.prompts.fit(ids, req))
        self.prompts.check_vocab(req.params.stop_token_ids, "sampling.stop_token_ids")
        progress = RequestProgress(ids, asdict(req.params), self.tokenizer)
        outcome = RequestOutcome(req.request_id or f"req-{uuid.uuid4().hex[:16]}", self.policy.name)
        self._stats.num_requests += 1
        self._stats.num_inflight += 1
        try:
            answer = self._answer(ids, progress, outcome, req)
            async with contextlib.aclosing(answer) as deltas:
                async for delta in deltas:
                    if delta.token_ids and outcome.ttft_s is None:
                        outcome.first_token(self.metrics)
                        self.admission.observe(outcome)
                    yield delta
            outcome.status = "ok"
        except (RouterError, WorkerDied) as exc:
            self._stats.num_failed += 1
            outcome.status = type(exc).__name__.lower()
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome.status = "cancelled"
            raise
        finally:
            self._stats.num_inflight -= 1
            outcome.num_resumes = progress.num_resumes
            outcome.done(self.metrics)

    async def _answer(
        self, ids: list[int], progress: RequestProgress, outcome: RequestOutcome, req: GenerateInput
    ) -> AsyncGenerator[StreamDelta, None]:
        """The response cache's answer when it has one; else the workers', stored when it is
        deterministic and finished normally."""
        key = None
        cacheable = req.use_response_cache and is_deterministic(req.params)
        if self.responses is not None and cacheable:
            fingerprint = self.pool.model.model_fingerprint
            key = response_key(fingerprint, req.cache_salt, ids, req.params)
        # Skipping the cache's reads (writes) skips the stored answers' too.
        if key is not None and not req.skip_cache_read:
            assert self.responses is not None
            shape = EntryShape(num_samples(req.params), self.pool.model.vocab_size)
            hit = await self.responses.get(key, shape)
            if hit is not None:
                for delta in hit.deltas((time.perf_counter() - outcome.started_s) * 1e3):
                    assert delta.usage is not None
                    outcome.usage(delta.usage)
                    yield delta
                return
        collector = ResponseCollector(num_samples(req.params))
        async with contextlib.aclosing(self._forward(progress, outcome, req)) as deltas:
            async for delta in deltas:
                collector.add(unexplained(delta))
                yield delta
        answer = collector.result()
        if key is not None and answer is not None and not req.skip_cache_write:
            assert self.responses is not None
            # Queued, not awaited: the stream ends now, whatever the store is doing.
            self.responses.offer(key, answer)

    async def _forward(
        self, progress: RequestProgress, outcome: RequestOutcome, req: GenerateInput
    ) -> AsyncGenerator[StreamDelta, None]:
        excluded: set[WorkerId] = set()
        handoff: Handoff | None = None
        last_error: RouterError = Unavailable("no attempt was made")
        # The worker knows the request by an id of this call alone: the client's id is not
        # unique across tenants, so an abort (a cancelled call) reaches only its own request
        # and a clash can tell nobody which ids another tenant has in flight.
        call_id = f"{outcome.request_id}/{uuid.uuid4().hex}"
        admit = functools.partial(self.admission.check_planned, outcome=outcome)
        affinity = scoped_key(req.cache_salt, req.affinity_key)
        for attempt in range(self.config.max_retries + 1):
            parts = progress.parts()
            # Every part continues the same prompt: the first one's blocks stand for all.
            prompt = parts[0].prompt_ids
            hashes = self.prompts.block_hashes(prompt, req.cache_salt)
            if attempt == 0 and (handoff := self.pd.plan(progress, hashes, excluded, admit)):
                record = functools.partial(self._record, outcome=outcome)
                first = self.pd.prefill(
                    handoff, progress, call_id, outcome, self._part, record, req
                )
                async with contextlib.aclosing(first) as deltas:
                    async for first_delta in deltas:
                        yield first_delta
                if progress.ended or all(s.finished for s in progress.samples):
                    return
                parts = progress.parts()
            placed = (handoff.take() if handoff else None) or self.placement.route(
                len(prompt), hashes, excluded, self.pd.serving_roles(), affinity
            )
            decision, holder = placed.decision, placed.holder
            misses = self._misses(req, hashes, decision.worker)
            if attempt == 0 and handoff is None:
                self.admission.check_placed(decision, len(prompt), outcome)
            self.metrics.decisions.labels(decision.policy, decision.worker).inc()
            outcome.route_reason = decision.reason
            if holder is not None:
                self.metrics.pull_hints.inc()
                if not decision.pull_blocks:  # the policy did not say it
                    outcome.route_reason += f"; may pull {holder.num_blocks} blocks from a holder"
            try:
                attempt_deltas = self._attempt(decision, parts, call_id, req, progress, holder)
                async with contextlib.aclosing(attempt_deltas) as deltas:
                    async for part, raw in deltas:
                        delta = progress.forward(part, raw, decision.worker)
                        if delta is None:
                            continue
                        if handoff is not None:
                            handoff.observe(delta, self.metrics, outcome)
                            delta = handoff.merged(delta)
                        if misses is not None:
                            delta = explained(delta, self.pool.model.block_size, misses)
                        if delta.usage is not None:
                            self._record(delta.usage, outcome)
                        yield delta
                        if progress.ended:
                            return
                return
            except WorkerDied as exc:
                if exc.started and not progress.resumable:
                    raise Unavailable(f"worker {exc.worker} died during the request") from exc
                last_error = Unavailable(f"worker {exc.worker} died during the request")
                if progress.started:
                    progress.resume()
                    _log.warning(
                        "worker died mid-stream; resuming elsewhere",
                        extra={"request_id": outcome.request_id, "worker": exc.worker},
                    )
            except Exhausted as exc:
                last_error = exc
            finally:  # its pull is over, or will not come: the prefill worker's pins go
                if handoff is not None:
                    handoff.let_go()
            excluded.add(decision.worker)
            if not self.placement.candidates_left(excluded):
                break
            if attempt < self.config.max_retries:
                self._stats.num_retries += 1
                kind = "mid_stream" if progress.started else "before_start"
                self.metrics.retries.labels(kind).inc()
        raise last_error

    def _misses(
        self, req: GenerateInput, hashes: list[BlockHash], worker: WorkerId
    ) -> tuple[str, ...] | None:
        """Note the retention the request asks; when it asks its cache use explained, why each
        of its blocks would be computed, as the index knows it now (before the request stores
        its own blocks)."""
        if req.retention_s:
            self.pool.ghosts.retained(hashes, req.retention_s)
        if not req.explain_cache:
            return None
        holders = self.pool.index.longest_prefix(hashes)
        return block_misses(hashes, holders, self.pool.ghosts, worker, req.skip_cache_read)

    async def _attempt(
        self,
        decision: RouteDecision,
        parts: list[Part],
        request_id: str,
        req: GenerateInput,
        progress: RequestProgress,
        holder: HolderHint | None = None,
    ) -> AsyncGenerator[tuple[Part, StreamDelta], None]:
        """The deltas of every part, as they come; a part whose sample the router ended is
        closed (which aborts it on the worker)."""
        streams = {
            part.sample: self._part(decision, part, _part_id(request_id, part), req, holder)
            for part in parts
        }
        by_sample = {part.sample: part for part in parts}

        def ended(sample: int | None) -> bool:
            return sample is not None and progress.done(sample)

        async with contextlib.aclosing(merged(streams, ended)) as deltas:
            async for sample, delta in deltas:
                yield by_sample[sample], delta

    async def _part(
        self,
        decision: RouteDecision,
        part: Part,
        request_id: str,
        req: GenerateInput,
        holder: HolderHint | None = None,
        hold_kv: bool = False,
    ) -> AsyncGenerator[StreamDelta, None]:
        state = self.pool.state(decision.worker)
        ids = part.prompt_ids
        covered = self.placement.covered_blocks(decision, holder)
        uncached = max(0, len(ids) - covered * self.pool.model.block_size)
        state.num_inflight += 1
        state.num_inflight_tokens += uncached
        prefilled = False
        num_finished = 0
        tick = self.admission.clock(decision.worker)  # times the stream's gaps
        try:
            hints = cache_hints(req)
            stream = self.pool.stream(
                decision.worker,
                ids,
                part.params,
                request_id,
                req.cache_salt,
                holder,
                hold_kv,
                hints,
            )
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    if not prefilled:
                        prefilled = True
                        state.num_inflight_tokens -= uncached
                        self.supervisor.poll_soon(decision.worker)  # its prompt's blocks
                    tick(delta.index, len(delta.token_ids))
                    if delta.usage is not None:
                        num_finished += 1
                        if num_finished == part.num_samples:
                            # Read-your-writes: once the client has the answer, the blocks it
                            # computed are visible to routing.
                            await self._sync_quietly(decision.worker)
                    yield delta
        finally:
            state.num_inflight -= 1
            if not prefilled:
                state.num_inflight_tokens -= uncached

    async def _sync_quietly(self, worker: WorkerId) -> None:
        try:
            await self.pool.sync(worker)
        except Exception:  # the answer is complete; the poller will catch up
            _log.warning("syncing worker %s after a request failed", worker, exc_info=True)

    def _record(self, usage: Usage, outcome: RequestOutcome) -> None:
        self._stats.prompt_tokens += usage.prompt_tokens
        self._stats.cached_tokens += sum(usage.cached_tokens.values())
        decisions = self._stats.decisions
        decisions[usage.worker_id] = decisions.get(usage.worker_id, 0) + 1
        self.pd.answered(usage)
        self.metrics.record_usage(usage)
        outcome.usage(usage)

    # ---- score ------------------------------------------------------------------------------

    async def score(self, req: ScoreInput) -> ScoreResult:
        """Per item, the log-probs of the label tokens after prefix + item
        (`router.request.scoring`)."""
        return await run_score(
            req, self.prompts, self.placement, self.pool, self.config.max_retries
        )

    # ---- cache control --------------------------------------------------------------------

    async def prewarm(self, inp: PrewarmInput) -> PrewarmResult:
        """Compute and keep a prompt's KV on the worker routing chooses, answering nothing
        (`router.request.prewarm`); raises as `generate` does."""
        usage = None
        async with contextlib.aclosing(self.generate(prewarm_request(inp))) as deltas:
            async for delta in deltas:
                usage = delta.usage or usage
        if usage is None:
            raise Unavailable("the prewarm ended without its worker's answer; retry")
        return prewarm_result(usage)

    async def close_session(self, tenant: str, session_id: str) -> int:
        """Demote the blocks `tenant`'s session retained, on every live worker; how many."""
        return await close_session(self.pool, tenant, session_id)

    async def set_quota(self, tenant: str, limits: TenantLimits) -> None:
        """Replace `tenant`'s limits, here and on every live worker (and those that join)."""
        self.quotas.set(tenant, limits)
        await push_quotas(self.pool, self.quotas.for_workers())

    async def tenant_usage(self) -> list[TenantUsage]:
        """Each tenant's blocks per tier, summed over the live workers."""
        usage = await tenant_usage(self.pool)
        self.metrics.record_tenant_usage(usage)
        return usage

    # ---- admin ------------------------------------------------------------------------------

    def stats(self) -> RouterStats:
        """A copy of the counters."""
        stats = RouterStats(**{f.name: getattr(self._stats, f.name) for f in fields(RouterStats)})
        stats.num_resyncs = self.pool.num_resyncs
        stats.decisions = dict(self._stats.decisions)
        return stats

    def workers(self) -> list[WorkerStatus]:
        return worker_statuses(self.pool)

    def is_serving(self) -> bool:
        """True while some worker is healthy (the gRPC health service's overall status)."""
        return bool(self.pool.healthy())

    async def flush(self) -> int:
        """Drop every unused cached block from every live worker's device pool (not moved to
        its lower tiers) and empty the response cache; returns how many blocks."""
        return await flush_workers(self.pool, self.responses)

    async def purge(self) -> dict[str, int]:
        """Make everything cached so far unreachable at once, then drop it (`admin.purge`);
        blocks per tier. Raises Unavailable, purging nothing, when the epoch cannot be stored."""
        return await purge(self.pool, self.responses)


def _part_id(request_id: str, part: Part) -> str:
    """The worker-side id of a part: the request's own, or one per resumed sample."""
    return request_id if part.sample is None else f"{request_id}.s{part.sample}"
