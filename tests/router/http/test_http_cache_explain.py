"""The OpenAI door's cache explanation: asked by body field or header, rendered in the usage."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.domain import InvalidInput
from router.http.cache_controls import explain_header
from router.http.parse import parse_chat, parse_completion
from router.http.render import Answer, full_response
from router.request.explain import (
    COMPUTED,
    LAST_BLOCK,
    NEVER_CACHED,
    CacheSegment,
    ExplainedUsage,
)
from workers.protocol import StreamDelta, Usage


def test_body_field_asks_it_and_is_typed() -> None:
    req = parse_completion({"prompt": "a", "cache_explain": True}, RouterConfig(), "r")
    assert req.inputs[0].explain_cache
    assert not parse_completion({"prompt": "a"}, RouterConfig(), "r").inputs[0].explain_cache
    chat = {"messages": [{"role": "user", "content": "hi"}], "cache_explain": True}
    assert parse_chat(chat, RouterConfig(), "r", 64).inputs[0].explain_cache
    with pytest.raises(InvalidInput, match="cache_explain"):
        parse_completion({"prompt": "a", "cache_explain": "yes"}, RouterConfig(), "r")


@pytest.mark.parametrize(
    ("value", "asked"),
    [(None, False), ("1", True), ("true", True), ("0", False), (" False", False)],
)
def test_header(value: str | None, asked: bool) -> None:
    assert explain_header(value) is asked


def test_bad_header_is_named() -> None:
    with pytest.raises(InvalidInput, match="x-cache-explain"):
        explain_header("2")


def _explained(prompt: int, cached: int, segments: tuple[CacheSegment, ...]) -> Usage:
    return ExplainedUsage(
        prompt, 1, {"hbm": cached}, prompt - cached, 1.0, None, "w0", explanation=segments
    )


def test_usage_carries_the_segments_of_each_prompt() -> None:
    one = (
        CacheSegment(0, 4, "hbm", "w0"),
        CacheSegment(4, 6, COMPUTED, "w0", LAST_BLOCK),
    )
    two = (
        CacheSegment(0, 4, COMPUTED, "w0", NEVER_CACHED),
        CacheSegment(4, 5, COMPUTED, "w0", LAST_BLOCK),
    )
    req = parse_completion({"prompt": "a", "cache_explain": True}, RouterConfig(), "r")
    answer = Answer(req)
    answer.add(0, StreamDelta(0, (1,), "x", "stop", _explained(6, 4, one)))
    usage = full_response(req, answer, "cmpl-r", "m", 1)["usage"]
    assert usage["cache_explanation"] == [
        {"start_token": 0, "end_token": 4, "source": "hbm", "miss_reason": ""},
        {"start_token": 4, "end_token": 6, "source": COMPUTED, "miss_reason": LAST_BLOCK},
    ]
    # Several prompts: each segment names its prompt, in prompt order.
    req = parse_completion({"prompt": ["a", "b"], "cache_explain": True}, RouterConfig(), "r")
    answer = Answer(req)
    answer.add(1, StreamDelta(0, (1,), "x", "stop", _explained(5, 0, two)))
    answer.add(0, StreamDelta(0, (1,), "y", "stop", _explained(6, 4, one)))
    segments = full_response(req, answer, "cmpl-r", "m", 1)["usage"]["cache_explanation"]
    assert [(s["prompt"], s["start_token"], s["miss_reason"]) for s in segments] == [
        (0, 0, ""),
        (0, 4, LAST_BLOCK),
        (1, 0, NEVER_CACHED),
        (1, 4, LAST_BLOCK),
    ]


def test_no_explanation_unless_asked() -> None:
    req = parse_completion({"prompt": "a"}, RouterConfig(), "r")
    answer = Answer(req)
    answer.add(0, StreamDelta(0, (1,), "x", "stop", Usage(6, 1, {}, 6, 1.0, None, "w0")))
    assert "cache_explanation" not in full_response(req, answer, "cmpl-r", "m", 1)["usage"]
