"""What the engine reports about a request: typed, plain values, no tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cachesvc.kv.types import RequestId


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request after a step.

    `token_ids` and `text` are the whole output so far; `delta_text` is what this step added.
    `num_cached_tokens` prompt tokens came from the prefix cache, `num_computed_tokens` were
    computed (recomputation after a preemption counts again). A request the engine failed while
    serving it (it alone: see `Engine.step`) ends with finish reason "error" and `error` says
    why.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    num_cached_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    # Cached prompt tokens by the tier they came from ("hbm" is the device pool).
    cached_tokens_by_tier: Mapping[str, int] = field(default_factory=dict)
    # Prompt tokens it wrote to the cache: full prompt blocks it computed and registered
    # first in the device pool (`Usage.cache_write_tokens`).
    num_cache_write_tokens: int = 0
    num_retained_tokens: int = 0  # `Usage.retained_tokens`
    num_retention_trimmed_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    # Some of the KV it was computed over came from a lossy (quantized) tier.
    lossy_kv: bool = False
    error: str | None = None  # set with finish reason "error" only


class RequestFailed(RuntimeError):
    """The engine failed while serving this request, for a reason of its own: the other
    requests of its steps went on. Raised by `Engine.generate` and by an `AsyncEngine` stream;
    retrying the request elsewhere would most likely fail the same way."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(request_id, message)
        self.request_id = request_id
        self.message = message

    def __str__(self) -> str:
        return f"request {self.request_id} failed: {self.message}"
