"""What the engine reports about a request: typed, plain values, no tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cachesvc.types import RequestId


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request after a step.

    `token_ids` and `text` are the whole output so far; `delta_text` is what this step added.
    `num_cached_tokens` prompt tokens came from the prefix cache, `num_computed_tokens` were
    computed (recomputation after a preemption counts again).
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
    # Some of the KV it was computed over came from a lossy (quantized) tier.
    lossy_kv: bool = False
