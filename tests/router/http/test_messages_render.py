"""Router deltas -> Anthropic messages: the body, the event stream's order and shapes, stop
reasons, usage split into input / cache creation / cache read, and the error shape."""

from __future__ import annotations

import json
from typing import Any

from router.http.errors import HttpError
from router.http.messages_render import (
    MessageAnswer,
    MessageEvents,
    error_event,
    error_payload,
    message_body,
)
from workers.protocol import StreamDelta, Usage

USAGE = Usage(30, 2, {"hbm": 8, "dram": 4}, 18, 1.0, None, "w0", cache_write_tokens=16)


def _events(data: bytes) -> list[tuple[str, Any]]:
    out = []
    for chunk in data.decode().split("\n\n")[:-1]:
        kind, payload = chunk.split("\n")
        assert kind.startswith("event: ") and payload.startswith("data: ")
        body = json.loads(payload[6:])
        assert body["type"] == kind[7:]
        out.append((kind[7:], body))
    return out


def test_message_body_and_usage_split() -> None:
    answer = MessageAnswer()
    answer.add(StreamDelta(0, (1,), "Hel"))
    answer.add(StreamDelta(0, (2,), "lo", "length", USAGE))
    body = message_body(answer, "msg_r", "m")
    assert body == {
        "id": "msg_r",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 2,  # 30 - 12 read - 16 written
            "cache_creation_input_tokens": 16,
            "cache_read_input_tokens": 12,
            "output_tokens": 2,
        },
    }


def test_stop_reasons() -> None:
    cases = [("stop", None, "end_turn"), ("stop", "END", "stop_sequence"), ("length", None, None)]
    for finish, stop, expected in cases:
        answer = MessageAnswer()
        answer.add(StreamDelta(0, (), "", finish, USAGE, stop))
        assert answer.stop_reason() == (expected or "max_tokens")
        assert answer.stop_sequence == stop


def test_stream_events_in_anthropics_order() -> None:
    events = MessageEvents("msg_r", "m")
    data = events.start()
    data += events.delta(StreamDelta(0, (1,), "Hi"))
    data += events.delta(StreamDelta(0, (2,), ""))  # nothing to say: no event
    data += events.delta(StreamDelta(0, (3,), " there", "stop", USAGE, "END"))
    data += events.end()
    parsed = _events(data)
    assert [k for k, _ in parsed] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = parsed[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 0  # not known before the prompt is computed
    assert parsed[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [b["delta"] for _, b in parsed[2:4]] == [
        {"type": "text_delta", "text": "Hi"},
        {"type": "text_delta", "text": " there"},
    ]
    final = parsed[5][1]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert final["usage"]["cache_read_input_tokens"] == 12
    assert final["usage"]["cache_creation_input_tokens"] == 16


def test_errors_in_anthropics_shape() -> None:
    err = HttpError(400, "max_tokens is required")
    payload = {"type": "error", "error": {"type": "invalid_request_error", "message": err.message}}
    assert error_payload(err) == payload
    assert error_payload(HttpError(429, "full"))["error"]["type"] == "rate_limit_error"
    assert error_payload(HttpError(503, "no worker"))["error"]["type"] == "api_error"
    assert _events(error_event(err)) == [("error", payload)]
