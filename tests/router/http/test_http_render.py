"""Router deltas -> OpenAI JSON and server-sent events: choice numbering, usage (a prompt counted
once, its cached tokens the least any sample found), the SSE framing and the end of a stream."""

from __future__ import annotations

import json
from typing import Any

from router.config import RouterConfig
from router.http.errors import HttpError
from router.http.parse import parse_chat, parse_completion
from router.http.render import DONE, Answer, StreamChunks, full_response
from workers.protocol import StreamDelta, Usage


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, {"hbm": cached}, prompt - cached, 1.0, None, "w0")


def _events(data: bytes) -> list[Any]:
    assert data.endswith(b"\n\n")
    events = data.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    return [e[6:] if e == DONE.rstrip() else json.loads(e[6:]) for e in events]


def test_choices_numbered_by_prompt_then_sample_and_usage_counts_prompts_once() -> None:
    req = parse_completion({"prompt": ["a", "b"], "n": 2}, RouterConfig(), "r")
    answer = Answer(req)
    deltas = [
        (0, StreamDelta(0, (1,), "x", "length", _usage(8, 1, 4))),
        (0, StreamDelta(1, (2,), "y", "length", _usage(8, 1, 8))),
        (1, StreamDelta(1, (3,), "z", "stop", _usage(5, 1, 0))),
        (1, StreamDelta(0, (4,), "w", "length", _usage(5, 1, 0))),
    ]
    assert [answer.add(p, d) for p, d in deltas] == [0, 1, 3, 2]
    body = full_response(req, answer, "cmpl-r", "m", 1)
    assert [c["text"] for c in body["choices"]] == ["x", "y", "w", "z"]
    assert body["choices"][3]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 13,
        "completion_tokens": 4,
        "total_tokens": 17,
        # The second sample of prompt 0 found the first one's blocks: not cached for the request.
        "prompt_tokens_details": {
            "cached_tokens": 4,
            "cached_tokens_by_tier": {"hbm": 4},
            "cache_write_tokens": 0,
            "retained_tokens": 0,
            "retention_trimmed_tokens": 0,
        },
    }


def test_chat_stream_framing_role_first_usage_last_then_done() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    body["stream_options"] = {"include_usage": True}
    req = parse_chat(body, RouterConfig(), "r", 64)
    chunks = StreamChunks(req, "chatcmpl-r", "m", 7)
    data = chunks.start()
    data += chunks.delta(0, StreamDelta(0, (1,), "Hel"))
    data += chunks.delta(0, StreamDelta(0, (2,), ""))  # an unfinished character: nothing sent
    data += chunks.delta(0, StreamDelta(0, (3,), "lo", "stop", _usage(6, 3, 4)))
    data += chunks.end()
    events = _events(data)
    assert events[-1] == b"[DONE]"
    role, first, last, usage = events[:-1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"] == {"content": "Hel"}
    assert last["choices"][0] == {
        "index": 0,
        "delta": {"content": "lo"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert all(
        e["object"] == "chat.completion.chunk" and e["id"] == "chatcmpl-r" for e in events[:-1]
    )
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_stream_without_usage_and_an_error_after_the_start() -> None:
    req = parse_completion({"prompt": "x", "stream": True}, RouterConfig(), "r")
    chunks = StreamChunks(req, "cmpl-r", "m", 7)
    assert chunks.start() == b"" and chunks.end() == DONE
    error = _events(chunks.error(HttpError(503, "worker died", "service_unavailable_error")))
    assert error[0]["error"]["message"] == "worker died" and error[1] == b"[DONE]"


def test_token_ids_on_request() -> None:
    req = parse_completion({"prompt": "x", "return_token_ids": True}, RouterConfig(), "r")
    answer = Answer(req)
    answer.add(0, StreamDelta(0, (5, 6), "ab"))
    answer.add(0, StreamDelta(0, (7,), "c", "length", _usage(1, 3, 0)))
    assert full_response(req, answer, "cmpl-r", "m", 1)["choices"][0]["token_ids"] == [5, 6, 7]
