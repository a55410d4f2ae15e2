"""The router's own request types and errors: what `server.py` translates proto into.

Errors carry a message that names the offending field in the wire's terms
(`sampling.max_tokens`, `prompt.token_ids[3]`); the server maps each class to one gRPC status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams


class RouterError(Exception):
    """Base of the errors a client can be told about."""


class InvalidInput(RouterError):
    """Bad client input (INVALID_ARGUMENT); the message names the field."""


class Exhausted(RouterError):
    """Every eligible worker (or the router) is full (RESOURCE_EXHAUSTED)."""


class Unavailable(RouterError):
    """No live worker, or one died after it started the request (UNAVAILABLE)."""


class Unimplemented(RouterError):
    """The request needs a feature this deployment lacks (UNIMPLEMENTED)."""


class RequestFailed(RouterError):
    """A worker failed while serving this request, for a reason of the request's own (INTERNAL,
    HTTP 500): the worker is fine, and another would fail alike, so it is not retried."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of `text`, `token_ids`, `messages` is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True


MAX_AFFINITY_KEY_LEN = 1024  # characters of an affinity key (OpenAI's prompt_cache_key's limit)
MAX_RETENTION_S = 24 * 3600  # the longest retention a client may ask (OpenAI's `24h`)


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    cache_salt: str | None = None
    use_response_cache: bool = True  # False: generate, and do not store the answer
    # The client set params.max_tokens: past the context it is refused, not lowered to fit.
    max_tokens_set: bool = False
    # How long the client asked the prompt's cache entry to be kept, in seconds (Anthropic's
    # `cache_control.ttl`, OpenAI's `prompt_cache_retention`); None: the default. A hint,
    # carried but not yet honoured: every block is evicted by the pool's own policy.
    retention_s: int | None = None
    # Requests with the same key belong together (OpenAI's `prompt_cache_key`): routed to the
    # same worker while it is within bounds (`router.request.affinity`); None: none.
    affinity_key: str | None = None
    # Reuse no cached KV for the prompt (a hint the workers do not honour yet; explained).
    skip_cache_read: bool = False
    explain_cache: bool = False  # answer where each part of the prompt came from


@dataclass(frozen=True)
class ScoreInput:
    request_id: str
    prefix: PromptInput
    items: tuple[PromptInput, ...]
    label_token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class ScoreResult:
    logprobs: tuple[tuple[float, ...], ...]  # per item, per label token
    worker_id: str


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as the Admin API reports it."""

    worker_id: str
    health: str  # healthy | unhealthy | dead
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    blocks: Mapping[str, tuple[int, int, int]]  # tier -> (total, used, cached)
    num_inflight: int
    num_indexed_blocks: int
    role: str = ""  # mixed | prefill | decode ("" until the worker has said)


@dataclass
class RouterStats:
    """Counters since start; mutated by the router only."""

    policy: str
    block_size: int = 0
    model_fingerprint: str = ""
    num_requests: int = 0
    num_failed: int = 0
    num_retries: int = 0
    num_inflight: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_resyncs: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # worker -> requests routed

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
