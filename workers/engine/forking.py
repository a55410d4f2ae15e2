"""Forking a running request: the child shares the parent's blocks, copy-on-write at the tail.

Used by parallel sampling (`n` samples of one prompt computed once) and beam search.
"""

from __future__ import annotations

from cachesvc.kv.types import RequestId
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request import Request, RequestStatus
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler
from workers.sampling_params import SamplingParams


class Forker:
    """Creates child requests that continue from a parent's computed KV."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner

    def fork(self, parent: Request, child_id: RequestId, params: SamplingParams) -> Request:
        """A running child with the parent's tokens and KV, scheduled right after the parent.

        Full blocks are shared by reference; the partially filled last block is copied now. When
        no block is free for that copy, the child waits in the queue instead and recomputes from
        its prefix-cache hits, so a fork never fails.
        """
        child = Request(
            child_id,
            list(parent.prompt_token_ids),
            params,
            eos_token_ids=parent.eos_token_ids,
            cache_salt=parent.cache_salt,
            arrival_time=parent.arrival_time,
            output_token_ids=list(parent.output_token_ids),
            first_token_time=parent.first_token_time,
        )
        child.num_cached_tokens = parent.num_prompt_tokens
        copies = self.kv.fork(parent, child)
        if copies is None:
            self.scheduler.waiting.appendleft(child)
            return child
        self.runner.copy_blocks(copies)
        child.status = RequestStatus.RUNNING
        self.scheduler.running.append(child)
        return child
