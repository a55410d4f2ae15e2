"""The one object that flows through the engine: a request and its own counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cachesvc.kv.types import BlockHash, BlockId, RequestId
from workers.engine.sampler import token_seed
from workers.protocol import CacheHints
from workers.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached or the model's context is full
    STOP = "stop"  # an EOS, a stop token id or a stop string
    ABORT = "abort"
    ERROR = "error"  # the engine failed while serving it (RequestOutput.error says why)


@dataclass(frozen=True)
class PeerSource:
    """Another worker holding the first `num_blocks` full blocks of a request's prompt (the
    router's holder hint): the load planner may pull them from it (`peer_pull`)."""

    name: str
    num_blocks: int
    # It computed the prompt for this request, handed off to decode here: it keeps the
    # blocks, so the copy here is evicted first once the request ends.
    handoff: bool = False


@dataclass(eq=False)
class Request:
    """A prompt being served; mutated in place by the scheduler and the engine.

    `num_computed_tokens` counts tokens whose KV is in `block_ids`. The tokens still to compute are
    `all_token_ids[num_computed_tokens:]`; once none remain the next token is sampled. A
    preempted request keeps its output and recomputes its KV from scratch when resumed.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # isolates this tenant's prefix cache from others'
    peer: PeerSource | None = None  # a worker holding more of the prompt, to pull it from
    cache: CacheHints = field(default_factory=CacheHints)  # retention, session, skip flags
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, grows
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Counters for the usage report: tokens served from the prefix cache and tokens computed.
    num_cached_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    # Prompt tokens this request wrote to the cache (`KVCacheManager` counts them).
    num_cache_write_tokens: int = 0
    # Prompt tokens under its retention when it last gave its blocks back, and those the
    # tenant's retention budget trimmed (`KVCacheManager.free`).
    num_retained_tokens: int = 0
    num_retention_trimmed_tokens: int = 0
    _generator: torch.Generator | None = field(default=None, repr=False)

    def next_generator(self) -> torch.Generator | None:
        """The generator for the next sampled token, None without a seed. It is re-seeded from
        (seed, index of that token in the whole output) every time, so the draw does not depend
        on how the request got here: a preemption's recompute or a stream resumed elsewhere
        samples the same token."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator()
        index = self.params.output_offset + len(self.output_token_ids)
        return self._generator.manual_seed(token_seed(self.params.seed, index))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole sequence (a decode step takes
        one token of it, per request, every step)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and its time."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)

    def finish(
        self, reason: FinishReason, now: float, stop_reason: str | int | None = None
    ) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = now
