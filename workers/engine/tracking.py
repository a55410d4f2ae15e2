"""Per-request output state the engine keeps: text, detokenizer, usage counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.engine.outputs import RequestOutput
from workers.engine.request import Request
from workers.engine.stop import StopDecision, check_stop
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer


@dataclass
class Tracked:
    """A request whose output a caller sees, with its streamed text."""

    request: Request
    detok: IncrementalDetokenizer | None
    text: str = ""
    num_computed: int = 0  # prompt tokens computed by the model for this request
    # The prompt as every snapshot reports it, made once: a copy per step and per request
    # would cost each step as much as the whole batch's context.
    prompt_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(self.request.prompt_token_ids)

    @classmethod
    def start(cls, request: Request, tokenizer: Tokenizer | None) -> Tracked:
        """A new request's tracking: its text detokenized as tokens come (none without a
        tokenizer: the caller reads ids)."""
        return cls(request, None if tokenizer is None else IncrementalDetokenizer(tokenizer))

    def count_computed(self, start_pos: int, num_tokens: int) -> None:
        """Count the prompt tokens of a chunk: cached + computed == prompt length (without
        preemption; recomputation after one counts again)."""
        num_prompt = len(self.request.prompt_token_ids)
        if start_pos < num_prompt:  # a decode chunk computes no prompt token
            self.num_computed += min(num_prompt, start_pos + num_tokens) - start_pos

    def add_token(
        self, token_id: int, now: float, max_model_len: int
    ) -> tuple[str, StopDecision | None]:
        """Record a sampled token: the text it adds, and whether the request must stop now
        (then the text is final: a stop string cut off, held-back bytes released). Mutates
        the request and the text; the caller finishes the request."""
        self.request.append_token(token_id, now)
        before = len(self.text)
        self.text += "" if self.detok is None else self.detok.add(token_id)
        decision = check_stop(self.request, self.text, before, max_model_len)
        if decision is not None and decision.truncate_text_at is not None:
            self.text = self.text[: decision.truncate_text_at]
        elif decision is not None and self.detok is not None:
            # Release text held back for an incomplete character at the very end.
            self.text += self.detok.finish()
        return self.text[before:], decision


def snapshot(
    tracked: Tracked,
    delta: str,
    tier_usage: Mapping[str, int] | None = None,
    lossy_kv: bool = False,
) -> RequestOutput:
    """The caller-facing view of a tracked request after a step.

    `tier_usage` splits the cached prompt tokens by tier; without it they all count as "hbm".
    `lossy_kv`: some of its KV came from a lossy tier (`KVTiering.lossy_kv`).
    """
    r = tracked.request
    ttft = None if r.first_token_time is None else (r.first_token_time - r.arrival_time) * 1e3
    tps = None
    if (
        r.finish_time is not None
        and r.first_token_time is not None
        and len(r.output_token_ids) > 1
        and r.finish_time > r.first_token_time
    ):
        tps = (len(r.output_token_ids) - 1) / (r.finish_time - r.first_token_time)
    return RequestOutput(
        request_id=r.request_id,
        prompt_token_ids=tracked.prompt_ids,
        token_ids=tuple(r.output_token_ids),
        text=tracked.text,
        delta_text=delta,
        finished=r.is_finished,
        finish_reason=None if r.finish_reason is None else r.finish_reason.value,
        ttft_ms=ttft,
        decode_tokens_per_s=tps,
        num_cached_tokens=r.num_cached_tokens,
        num_computed_tokens=tracked.num_computed,
        num_preemptions=r.num_preemptions,
        cached_tokens_by_tier=_by_tier(r.num_cached_tokens, tier_usage),
        num_cache_write_tokens=r.num_cache_write_tokens,
        num_retained_tokens=r.num_retained_tokens,
        num_retention_trimmed_tokens=r.num_retention_trimmed_tokens,
        stop_sequence=r.stop_reason if isinstance(r.stop_reason, str) else None,
        lossy_kv=lossy_kv,
    )


def beam_snapshot(request: Request, tokenizer: Tokenizer | None, lossy_kv: bool) -> RequestOutput:
    """The final output of a beam search, `request` being its best beam: its text decoded at
    once (a beam's tokens were never streamed), and every prompt token not cached computed."""
    tracked = Tracked.start(request, tokenizer)
    if tokenizer is not None:
        tracked.text = tokenizer.decode(request.output_token_ids)
    tracked.num_computed = request.num_prompt_tokens - request.num_cached_tokens
    return snapshot(tracked, tracked.text, lossy_kv=lossy_kv)


def _by_tier(num_cached: int, tier_usage: Mapping[str, int] | None) -> dict[str, int]:
    if not tier_usage:  # no tiers: all from the device pool (the common case, every step)
        return {"hbm": num_cached} if num_cached else {}
    usage = {k: v for k, v in (tier_usage or {}).items() if v}
    if not usage and num_cached:
        usage = {"hbm": num_cached}
    return usage
