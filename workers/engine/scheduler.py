"""Continuous batching with chunked prefill, a token budget and preemption.

Each step the scheduler decides how many new tokens each request computes: running requests
first (decodes and unfinished prefill chunks), then waiting ones in arrival order, until the
token budget or the sequence limit is reached. When the pool cannot hold a running request's next
tokens, the most recently arrived running request is preempted: its blocks are freed and it goes
back to the head of the queue, to be recomputed later.

The requests of a failed model run become suspects (`workers.engine.suspects`): while one has
work, a step holds that one alone, and no suspect joins a batch of others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cachesvc.kv.types import BlockId, RequestId
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request import Request, RequestStatus
from workers.engine.suspects import Suspects


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one request to compute this step."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0] in the request's sequence
    block_ids: tuple[BlockId, ...]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    """What the runner computes this step."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[RequestId, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting queue and the running list; mutates requests' counters and blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.suspects = Suspects()  # told how each model run went by the engine

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; allocates blocks and may preempt running requests.

        While a suspect has work, the step holds the first such (in the suspects' order, one
        already running first) alone; when it cannot be placed now, the others run instead."""
        self.kv.begin_step()
        suspect = self._next_suspect()
        if suspect is not None:
            output = self._pick(lambda r: r is suspect)
            if output.chunks or output.preempted:
                return output
        return self._pick(lambda r: r.request_id not in self.suspects)

    def _pick(self, eligible: Callable[[Request], bool]) -> SchedulerOutput:
        """Schedule the `eligible` requests: running ones first, then waiting ones in order."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[RequestId] = []
        scheduled: list[Request] = []
        for request in list(self.running):
            # A request preempted earlier in this loop is waiting again (a status test, not a
            # search of the running list: that made a step quadratic in its requests).
            if budget == 0 or request.status is not RequestStatus.RUNNING:
                continue
            self.kv.land_ready(request)  # a pull that arrived since the last step
            if not eligible(request):
                continue
            num_new = min(self.kv.num_computable(request), budget)
            if num_new == 0:
                continue  # a beam waiting for its siblings' logits has nothing to compute
            if not self._allocate_or_preempt(request, num_new, scheduled, preempted):
                continue
            scheduled.append(request)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, chunks, eligible)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _next_suspect(self) -> Request | None:
        """The suspect to run alone now: the first in order that has work, a running one (it
        holds blocks) before a waiting one; None when there is none."""
        if not self.suspects:
            return None
        order = {rid: i for i, rid in enumerate(self.suspects.in_order())}
        candidates = [
            r for r in self.running if r.request_id in order and self.kv.num_computable(r) > 0
        ] or [r for r in self.waiting if r.request_id in order]
        return min(candidates, key=lambda r: order[r.request_id], default=None)

    def update(self, output: SchedulerOutput) -> None:
        """The model run of `output` succeeded: advance the counters of every request it
        computed, and tell the suspects."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in output.chunks:
            request = by_id[chunk.request_id]
            request.num_computed_tokens += len(chunk.token_ids)
            self.kv.on_computed(request)  # a fetch planned to land here lands now
        self.suspects.on_run(output.chunks)

    def requeue(self, output: SchedulerOutput) -> None:
        """The step computing `output` failed: each of its requests gives its blocks back and
        waits at the head of the queue, to be recomputed as if preempted, so that none counts
        KV that was never written. Call after `KVCacheManager.abort_step`."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in reversed(output.chunks):  # the first ends up first in the queue
            request = by_id.get(chunk.request_id)
            if request is not None:
                self._preempt(request)

    def finish(self, request: Request) -> None:
        """Take a finished or aborted request out and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self.suspects.discard(request.request_id)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        scheduled: list[Request],
        preempted: list[RequestId],
    ) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]
            if victim in scheduled:
                # Nothing unscheduled is left to preempt; this request waits for next step.
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_waiting(
        self, budget: int, chunks: list[ScheduledChunk], eligible: Callable[[Request], bool]
    ) -> int:
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if not eligible(request):
                deferred.append(request)  # keeps its place in the queue
                continue
            match = self.kv.match_prefix(request)
            if match.joins_pull or (match.stopped_at_in_flight and self.kv.in_batch == "defer"):
                # Batch split + cache: wait for the blocks this step computes (or another
                # request's pull brings), then hit them.
                self._release(request)
                deferred.append(request)
                continue
            num_new = self._num_new_for(request, budget, bool(chunks))
            if num_new == 0 and self.kv.awaits_load(request):
                self._start(request, match.num_cached_tokens)  # computes once its KV landed
                continue
            if num_new == 0 or not self.kv.allocate_slots(request, num_new):
                self._release(request)  # give the prefix hits back; retry next step
                self.waiting.appendleft(request)
                break
            self._start(request, match.num_cached_tokens)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _start(self, request: Request, num_cached_tokens: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _num_new_for(self, request: Request, budget: int, batch_has_work: bool) -> int:
        """Tokens to compute for a newly admitted request; 0 when it must wait."""
        remaining = self.kv.num_computable(request)
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        if remaining <= budget or not batch_has_work:
            return remaining  # an oversized prompt still runs, alone in its step
        return 0

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        tokens = request.token_slice(start, start + num_new)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(tokens),
            start_pos=start,
            block_ids=tuple(request.block_ids),
            sample=start + num_new == request.num_tokens,
        )
