"""The HTTP door at its edges, over real Ray workers: ids that cannot be a header, lone
surrogates in any string, unknown roles, token limits past the context, special-token options,
internal errors logged, and a client that hangs up while sending its body."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from http_support import MODEL_NAME, call, error_of, start_http, stop_http

from router.http.server import HttpServer

pytestmark = pytest.mark.system
CONTEXT = 512  # the tiny model's (conftest)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def door(make_server: Any) -> Iterator[tuple[Any, HttpServer]]:
    server = make_server()
    http = start_http(server)
    yield server, http
    stop_http(server, http)


def _chat(content: Any = "hello world", **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **body}


def _completion(prompt: Any = "hello world", **body: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, **body}


def _refused(http: HttpServer, path: str, body: Any, param: str) -> str:
    status, _, data = call(http, "POST", path, body)
    error = error_of(data)
    assert (status, error["param"]) == (400, param), (status, error)
    assert error["type"] == "invalid_request_error"
    message: str = error["message"]
    return message


def _internal(server: Any, method: str) -> float:
    value: float = server.router.metrics.requests.labels("http", method, "INTERNAL")._value.get()
    return value


@pytest.mark.parametrize(
    "request_id", ["a\r\nx-injected: 1", "line\nbreak", "id-\u8bf7\u6c42", "\x00"]
)
def test_a_request_id_that_cannot_be_a_header_is_refused(
    door: tuple[Any, HttpServer], request_id: str
) -> None:
    server, http = door
    before = _internal(server, "ChatCompletions")
    _refused(http, CHAT, _chat(request_id=request_id), "request_id")
    assert _internal(server, "ChatCompletions") == before


def test_a_latin1_request_id_is_echoed_in_the_header(door: tuple[Any, HttpServer]) -> None:
    status, headers, data = call(door[1], "POST", CHAT, _chat(request_id="caf\u00e9-1"))
    assert status == 200, data
    assert headers["x-request-id"] == "chatcmpl-caf\u00e9-1" == json.loads(data)["id"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, _chat("\ud800"), "messages[0].content"),
        (
            CHAT,
            _chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "a\udfff"}]),
            "messages[0].content[1].text",
        ),
        (
            CHAT,
            {**_chat(), "messages": [{"role": "us\ud800er", "content": "x"}]},
            "messages[0].role",
        ),
        (CHAT, _chat(stop=["ok", "\udc00"]), "stop[1]"),
        (CHAT, _chat(user="\ud83d"), "user"),
        (CHAT, _chat(cache_salt="s\ud800"), "cache_salt"),
        (CHAT, _chat(request_id="r\ud800"), "request_id"),
        (CHAT, _chat(model="\ud800"), "model"),
        (COMPLETIONS, _completion("\ud800"), "prompt"),
        (COMPLETIONS, _completion(["fine", "bad \udbff"]), "prompt[1]"),
    ],
)
def test_a_lone_surrogate_in_any_string_names_its_field(
    door: tuple[Any, HttpServer], path: str, body: dict[str, Any], param: str
) -> None:
    server, http = door
    message = _refused(http, path, body, param)
    assert "surrogate" in message
    assert _internal(server, "ChatCompletions") == _internal(server, "Completions") == 0


def test_an_unknown_role_is_refused(door: tuple[Any, HttpServer]) -> None:
    body = {
        **_chat(),
        "messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
    }
    assert "robot" in _refused(door[1], CHAT, body, "messages[1].role")
    roles = ["system", "developer", "user", "assistant", "tool", "user"]
    body = {**_chat(), "messages": [{"role": r, "content": "hi"} for r in roles]}
    status, _, data = call(door[1], "POST", CHAT, body)
    assert status == 200, data


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_refused(door: tuple[Any, HttpServer], field: str) -> None:
    http = door[1]
    _refused(http, CHAT, {**_chat(), "max_tokens": None, field: 10**12}, "max_tokens")
    message = _refused(http, CHAT, {**_chat(), "max_tokens": None, field: 1000}, "max_tokens")
    assert f"maximum context length is {CONTEXT} tokens" in message
    prompt = [7] * 500
    message = _refused(
        http, COMPLETIONS, _completion(prompt, **{"max_tokens": None, field: 13}), "max_tokens"
    )
    assert "you requested 513 tokens (500 in the prompt, 13 in the completion)" in message
    # Exactly at the context is served.
    body = _completion(prompt, ignore_eos=True, **{"max_tokens": None, field: 12})
    status, _, data = call(http, "POST", COMPLETIONS, body)
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 12


def test_without_max_tokens_the_answer_fits_the_context(door: tuple[Any, HttpServer]) -> None:
    http = door[1]
    body = _completion([7] * 505, max_tokens=None, ignore_eos=True)  # default 16: 7 fit
    status, _, data = call(http, "POST", COMPLETIONS, body)
    reply = json.loads(data)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 7
    assert reply["choices"][0]["finish_reason"] == "length"
    body = _chat("hello " * 200, max_tokens=None, ignore_eos=True, temperature=0)
    status, _, data = call(http, "POST", CHAT, body)
    usage = json.loads(data)["usage"]
    assert status == 200 and usage["total_tokens"] == CONTEXT


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (CHAT, "skip_special_tokens"),
        (COMPLETIONS, "skip_special_tokens"),
        (CHAT, "spaces_between_special_tokens"),
        (COMPLETIONS, "spaces_between_special_tokens"),
        (CHAT, "add_special_tokens"),
    ],
)
def test_special_token_options_the_door_cannot_honour_are_refused(
    door: tuple[Any, HttpServer], path: str, field: str
) -> None:
    body = _chat() if path == CHAT else _completion()
    # Chat adds no special tokens (its template has them): true asks for something else.
    value = field == "add_special_tokens"
    assert field in _refused(door[1], path, {**body, field: value}, field)


def test_completions_honour_add_special_tokens_false(door: tuple[Any, HttpServer]) -> None:
    body = _completion("hello world", add_special_tokens=False, temperature=0)
    status, _, data = call(door[1], "POST", COMPLETIONS, body)
    assert status == 200, data


def test_an_internal_error_is_logged_with_the_request_id(
    door: tuple[Any, HttpServer], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, http = door

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an injected fault")

    monkeypatch.setattr(server.router.prompts, "encode", broken)
    caplog.set_level(logging.ERROR, logger="router.http")
    status, _, data = call(http, "POST", CHAT, _chat(request_id="boom-1"))
    assert status == 500 and error_of(data)["message"] == "internal error: RuntimeError"
    [record] = [r for r in caplog.records if r.name.startswith("router.http")]
    assert getattr(record, "request_id", None) == "boom-1"
    assert record.exc_info is not None and "an injected fault" in str(record.exc_info[1])


def test_a_client_gone_while_sending_its_body_is_a_cancellation(
    door: tuple[Any, HttpServer],
) -> None:
    server, http = door
    metrics = server.router.metrics.requests
    before = metrics.labels("http", "Completions", "CANCELLED")._value.get()
    body = json.dumps(_completion()).encode()
    with socket.create_connection(("127.0.0.1", http.port), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metrics.labels("http", "Completions", "CANCELLED")._value.get() > before:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the hang-up was not counted as a cancellation")
    assert _internal(server, "Completions") == 0
