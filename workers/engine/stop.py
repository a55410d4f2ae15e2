"""Stop conditions, checked after each sampled token."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import FinishReason, Request


@dataclass(frozen=True)
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None = None
    truncate_text_at: int | None = None  # cut the text here (a stop string is not returned)


def check_stop(
    request: Request, text: str, text_before: int, max_model_len: int
) -> StopDecision | None:
    """Whether `request` must finish after its newest token; None keeps it running.

    `text` is the output text so far and `text_before` its length before the newest token, so a
    stop string is only searched where it could newly appear.
    """
    params = request.params
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        return StopDecision(FinishReason.STOP, last)
    if last in params.stop_token_ids:
        return StopDecision(FinishReason.STOP, last)
    for stop in params.stop:
        at = text.find(stop, max(0, text_before - len(stop) + 1))
        if at >= 0:
            return StopDecision(FinishReason.STOP, stop, truncate_text_at=at)
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return StopDecision(FinishReason.LENGTH)
    return None
