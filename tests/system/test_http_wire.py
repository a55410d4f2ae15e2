"""The HTTP door on the wire, with raw HTTP: the server-sent event framing, OpenAI's error
bodies and statuses, bodies refused before they are read, health, and a client that hangs up
mid-stream aborting its request on the worker."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from http_support import MODEL_NAME, start_http, stop_http

from router.http.body import MAX_BODY_BYTES

pytestmark = pytest.mark.system
TOKEN = "wire-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def door(make_server: Any) -> Iterator[tuple[Any, Any]]:
    server = make_server(auth_token=TOKEN)
    http = start_http(server)
    yield server, http
    stop_http(server, http)


def _call(
    door: tuple[Any, Any], method: str, path: str, body: Any = None, headers: Any = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", door[1].port, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, AUTH if headers is None else headers)
    reply = conn.getresponse()
    result = reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    conn.close()
    return result


def _error(body: bytes) -> dict[str, Any]:
    payload = json.loads(body)
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = payload["error"]
    return error


def test_sse_framing_of_a_chat_stream(door: tuple[Any, Any]) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, data = _call(door, "POST", "/v1/chat/completions", body)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert data.endswith(b"data: [DONE]\n\n")
    events = data.split(b"\n\n")
    assert events[-1] == b"", "every event ends with a blank line"
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1])
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert len({c["id"] for c in chunks}) == 1 and headers["x-request-id"] == chunks[0]["id"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_error_bodies_and_statuses(door: tuple[Any, Any]) -> None:
    ok = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    status, headers, body = _call(door, "POST", "/v1/completions", ok, {"Authorization": "x"})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert _error(body)["code"] == "invalid_api_key"

    status, _, body = _call(door, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in _error(body)["message"]

    status, _, body = _call(door, "POST", "/v1/completions", {**ok, "logprobs": 2})
    error = _error(body)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert "logprobs" in error["message"]

    status, _, body = _call(door, "POST", "/v1/completions", {**ok, "model": "other"})
    assert status == 404 and _error(body)["code"] == "model_not_found"

    status, _, body = _call(door, "POST", "/v1/completions", {**ok, "prompt": "x" * 10**6})
    assert status == 400 and "prompt" in _error(body)["message"], "longer than the context"

    status, _, body = _call(door, "GET", "/v1/nowhere")
    assert status == 404 and "/v1/nowhere" in _error(body)["message"]
    status, _, body = _call(door, "GET", "/v1/completions")
    assert status == 405 and _error(body)["message"]


def test_oversized_body_is_refused_before_it_is_sent(door: tuple[Any, Any]) -> None:
    # Only the headers go out: the answer must come without the server waiting for the body.
    with socket.create_connection(("127.0.0.1", door[1].port), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n"
        )
        sock.sendall(head.encode())
        reply = sock.makefile("rb").read()
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"413"
    assert b"at most" in rest.partition(b"\r\n\r\n")[2]


def test_health_and_models(door: tuple[Any, Any]) -> None:
    assert _call(door, "GET", "/health", headers={})[0] == 200, "no token needed"
    status, _, body = _call(door, "GET", "/v1/models", headers={})
    assert status == 401
    status, _, body = _call(door, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL_NAME
    door[1].door.closing = True  # as while draining
    try:
        assert _call(door, "GET", "/health", headers={})[0] == 503
    finally:
        door[1].door.closing = False


def test_client_hanging_up_mid_stream_aborts_the_request(
    door: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.requests")
    server, http = door
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": [11, 12, 13, 14, 15],
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", http.port), timeout=60) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"X-Request-Id: hangup-1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    # The socket is closed: the router must cancel the stream, which aborts it on the worker.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = [r for r in caplog.records if getattr(r, "request_id", None) == "hangup-1"]
        if done:
            break
        time.sleep(0.05)
    assert [r.status for r in done] == ["cancelled"]  # type: ignore[attr-defined]
    assert done[0].completion_tokens < 480  # type: ignore[attr-defined]
    while time.monotonic() < deadline:
        workers = server.router.workers()
        if all(w.num_inflight == 0 and w.num_running + w.num_waiting == 0 for w in workers):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the worker still runs the request its client left")
    counted = server.router.metrics.requests.labels("http", "Completions", "CANCELLED")
    assert counted._value.get() == 1
