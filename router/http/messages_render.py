"""Router deltas -> Anthropic Messages JSON: the message, its server-sent event stream, usage
and errors, in the shapes Anthropic documents.

Usage splits the prompt as Anthropic does: `cache_read_input_tokens` (read from the cache, any
tier), `cache_creation_input_tokens` (written to it by this request: `Usage.cache_write_tokens`)
and `input_tokens`, the rest; the three add up to the prompt. A stream cannot know the split
before the prompt is computed: its `message_start` says 0 for each, and its `message_delta`
carries the whole usage (Anthropic's counts there are cumulative, and its SDK takes them).
"""

from __future__ import annotations

import json
from typing import Any

from router.http.errors import HttpError
from workers.protocol import StreamDelta, Usage

# Our finish reasons -> Anthropic's stop reasons; "stop" is end_turn unless a stop string
# ended the answer (then stop_sequence, naming it).
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}
# HTTP status -> Anthropic's error type (its SDK picks the exception class by status).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class MessageAnswer:
    """What a request's deltas add up to (one sample); mutated by `add`."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None

    def add(self, delta: StreamDelta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_sequence = delta.stop_sequence
        if delta.usage is not None:
            self.usage = delta.usage

    def stop_reason(self) -> str | None:
        if self.finish_reason is None:
            return None
        if self.stop_sequence is not None:
            return "stop_sequence"
        return _STOP_REASONS.get(self.finish_reason, "end_turn")


def usage_body(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage object of a sample's usage (zeros before it is known)."""
    if usage is None:
        return {
            "input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
    return {
        "input_tokens": usage.uncached_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
        "cache_read_input_tokens": usage.cache_read_tokens,
        "output_tokens": usage.completion_tokens,
    }


def message_body(answer: MessageAnswer, message_id: str, model: str) -> dict[str, Any]:
    """The body of a non-streaming answer (and, empty, of `message_start`)."""
    text = "".join(answer.parts)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}] if answer.finish_reason else [],
        "stop_reason": answer.stop_reason(),
        "stop_sequence": answer.stop_sequence,
        "usage": usage_body(answer.usage),
    }


class MessageEvents:
    """The server-sent events of one streaming answer: `message_start`, one text block
    (`content_block_start`, its `content_block_delta`s, `content_block_stop`), then
    `message_delta` (stop reason, usage) and `message_stop`."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.answer = MessageAnswer()

    def start(self) -> bytes:
        message = message_body(self.answer, self.message_id, self.model)
        block = {"type": "text", "text": ""}
        return _event("message_start", {"message": message}) + _event(
            "content_block_start", {"index": 0, "content_block": block}
        )

    def delta(self, delta: StreamDelta) -> bytes:
        """The event of one delta; b"" for one without text."""
        self.answer.add(delta)
        if not delta.text:
            return b""
        body = {"index": 0, "delta": {"type": "text_delta", "text": delta.text}}
        return _event("content_block_delta", body)

    def end(self) -> bytes:
        answer = self.answer
        delta = {"stop_reason": answer.stop_reason(), "stop_sequence": answer.stop_sequence}
        return (
            _event("content_block_stop", {"index": 0})
            + _event("message_delta", {"delta": delta, "usage": usage_body(answer.usage)})
            + _event("message_stop", {})
        )


def error_payload(err: HttpError) -> dict[str, Any]:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_event(err: HttpError) -> bytes:
    """An error after the stream started (its status is sent already), as Anthropic ends one."""
    return _sse("error", error_payload(err))


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return _sse(kind, {"type": kind, **body})


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()
