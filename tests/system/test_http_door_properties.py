"""Hypothesis drives the HTTP door with generated bodies over real Ray workers: extreme numbers
(1e308, 1e-300, huge integers, NaN and Infinity tokens), hostile text (lone surrogates, NUL,
RTL marks, CR/LF), wrong types, huge values and deep nesting. Every answer is a success or a
4xx in OpenAI's error shape, never a 5xx or a reset connection; a greedy stream running
through it all, and a request after it, have the tokens they had before."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from http_support import MODEL_NAME, call, error_of, start_http, stop_http
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from router.http.server import HttpServer

pytestmark = pytest.mark.system
VOCAB = 320
# A placeholder string the encoder swaps for a raw JSON fragment Python cannot dump (10k
# nested arrays) or that is not JSON at all (NaN, Infinity).
_RAW = "\x00raw:"
HOSTILE = st.sampled_from(
    ["\ud800", "a\udfffb", "\udbff\ud800", "\x00", "nul\x00mid", "\u202eevil\u202c", "\r\n", ""]
)
CLEAN = st.text(st.characters(codec="utf-8"), max_size=24)
TEXT = st.one_of(HOSTILE, CLEAN, st.text(st.characters(exclude_categories=()), max_size=24))
NUMBERS = st.one_of(
    st.sampled_from([1e308, -1e308, 1e-300, -1e-300, 5e-324, 0, -1, 0.5, 2**31, 2**63, 2**64]),
    st.integers(-(10**30), 10**30),
    st.just(10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([f"{_RAW}NaN", f"{_RAW}Infinity", f"{_RAW}-Infinity"]),
)
DEEP = st.just(_RAW + "[" * 10_000 + "]" * 10_000)
HUGE = st.one_of(st.just("x" * 200_000), st.just(list(range(5000))))
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
NESTED = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
# Messages of the right shape with anything in them.
ODD_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "robot", ""]) | HOSTILE | NESTED,
            "content": TEXT
            | NESTED
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | NESTED})),
        }
    ),
    min_size=1,
    max_size=3,
)
WILD = st.one_of(HOSTILE, st.lists(HOSTILE, min_size=1, max_size=2), NUMBERS, NESTED, DEEP, HUGE)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
        "content": CLEAN
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": CLEAN}), max_size=3),
    }
)
# Per field, values the door must serve (small, so every example is quick); any field may
# instead be drawn from WILD.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 5]),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(CLEAN.filter(bool), max_size=2),
    "stream": st.booleans(),
    "user": CLEAN,
    "cache_salt": CLEAN,
    "request_id": st.text(st.characters(codec="latin-1", exclude_categories=("Cc",)), max_size=24),
    "ignore_eos": st.booleans(),
    "beam_width": st.just(1),
    "length_penalty": st.sampled_from([0.5, 1.0]),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "return_token_ids": st.booleans(),
    "logprobs": st.just(None),
    "skip_special_tokens": st.just(True),
}
PROMPT = st.one_of(
    CLEAN.filter(bool),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
    st.lists(CLEAN.filter(bool), min_size=1, max_size=3),
)


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> tuple[dict[str, Any], bool]:
    """A body with a few of the fields and whether it is well-formed: about half are; the
    others have one to three fields (or the prompt, messages, model, or a field no one
    serves) drawn from anything."""
    names = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=6))
    others = {"prompt", "messages", "model", "logit_bias", "messages" if chat else "prompt"}
    wild = draw(
        st.just(set()) | st.sets(st.sampled_from(sorted(names | others)), min_size=1, max_size=3)
    )
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4}
    if chat:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(PROMPT)
    for name in names:
        body[name] = draw(FIELDS[name])
    for name in wild:
        body[name] = draw(ODD_MESSAGES | WILD if name == "messages" else WILD)
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body, not wild


def encoded(body: dict[str, Any]) -> bytes:
    """`body` as JSON text, the placeholders replaced by their raw fragments."""
    text = json.dumps(body)  # ensure_ascii: a lone surrogate becomes a \\ud800 escape
    while (start := text.find('"\\u0000raw:')) >= 0:
        end = text.index('"', start + 1)
        text = text[:start] + text[start + len('"\\u0000raw:') : end] + text[end + 1 :]
    return text.encode()


def check_answer(
    body: dict[str, Any], valid: bool, status: int, headers: dict[str, str], data: bytes
) -> str:
    """Fail unless the answer is a success, or a 4xx in OpenAI's error shape to a body that is
    not well-formed; returns what it was, for Hypothesis' statistics."""
    stream = body.get("stream") is True
    if 400 <= status < 500 and not valid:
        error = error_of(data)
        assert error["type"] and error["message"], error
        return f"{status} {error['param']}"
    assert status == 200, (status, data[:2000])
    if stream and headers["content-type"].startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n"), data[-2000:]
        assert b'"error"' not in data, data[-2000:]
        return "200 stream"
    reply = json.loads(data)
    assert reply["choices"] and reply["usage"]["completion_tokens"] >= 1, reply
    return "200"


@pytest.fixture(scope="module")
def door(make_server: Any) -> Iterator[tuple[Any, HttpServer]]:
    server = make_server(max_queued_per_worker=64)
    http = start_http(server)
    yield server, http
    stop_http(server, http)


GREEDY = {
    "model": MODEL_NAME,
    "prompt": "Routing sends each request to the worker that already holds its prefix.",
    "max_tokens": 160,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def _greedy_tokens(http: HttpServer) -> list[int]:
    status, _, data = call(http, "POST", "/v1/completions", GREEDY)
    assert status == 200, data
    tokens: list[int] = json.loads(data)["choices"][0]["token_ids"]
    return tokens


@pytest.fixture(scope="module")
def background(door: tuple[Any, HttpServer]) -> Iterator[dict[str, Any]]:
    """The greedy tokens before any generated body, and a thread streaming the same request
    while the bodies come (joined by the last test)."""
    reference = _greedy_tokens(door[1])
    state: dict[str, Any] = {"reference": reference}

    def stream() -> None:
        status, _, data = call(door[1], "POST", "/v1/completions", {**GREEDY, "stream": True})
        events = [e[6:] for e in data.split(b"\n\n") if e.startswith(b"data: {")]
        state["status"] = status
        state["streamed"] = [t for e in events for t in json.loads(e)["choices"][0]["token_ids"]]

    thread = threading.Thread(target=stream)
    thread.start()
    state["thread"] = thread
    yield state
    thread.join(300)


_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)


@_SETTINGS
@given(drawn=bodies(chat=True))
def test_generated_chat_bodies_are_served_or_refused(
    door: tuple[Any, HttpServer], background: dict[str, Any], drawn: tuple[dict[str, Any], bool]
) -> None:
    body, valid = drawn
    answer = call(door[1], "POST", "/v1/chat/completions", encoded(body))
    event(check_answer(body, valid, *answer))


@_SETTINGS
@given(drawn=bodies(chat=False))
def test_generated_completion_bodies_are_served_or_refused(
    door: tuple[Any, HttpServer], background: dict[str, Any], drawn: tuple[dict[str, Any], bool]
) -> None:
    body, valid = drawn
    answer = call(door[1], "POST", "/v1/completions", encoded(body))
    event(check_answer(body, valid, *answer))


def test_the_worker_keeps_its_greedy_tokens(
    door: tuple[Any, HttpServer], background: dict[str, Any]
) -> None:
    server, http = door
    background["thread"].join(300)
    assert background["status"] == 200
    assert background["streamed"] == background["reference"], "the stream through the bodies"
    assert _greedy_tokens(http) == background["reference"], "a request after them"
    for method in ("ChatCompletions", "Completions"):
        internal = server.router.metrics.requests.labels("http", method, "INTERNAL")
        assert internal._value.get() == 0, method
