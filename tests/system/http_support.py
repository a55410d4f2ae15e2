"""The HTTP door beside a test router: started on the router's own loop, on a free port."""

from __future__ import annotations

import http.client as http_client
import json
from typing import Any

from router.http.server import HttpServer

MODEL_NAME = "tiny"


def start_http(server: Any, model_name: str = MODEL_NAME) -> HttpServer:
    """An HttpServer over `server`'s router (a `ServerThread`), listening; stop it with
    `stop_http`."""

    async def start() -> HttpServer:
        router = server.router
        http = HttpServer(router, router.config, 0, model_name)
        await http.start()
        return http

    http: HttpServer = server.run(start())
    return http


def stop_http(server: Any, http: HttpServer) -> None:
    if not server.loop.is_closed():
        server.run(http.stop(grace_s=1.0))


def base_url(http: HttpServer) -> str:
    return f"http://127.0.0.1:{http.port}/v1"


def call(
    http: HttpServer,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request to the door (a JSON-encoded `body` unless it is bytes): status,
    headers (lower-cased names) and body."""
    conn = http_client.HTTPConnection("127.0.0.1", http.port, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    result = reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    conn.close()
    return result


def error_of(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI error body; fails unless the body has exactly its shape."""
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    error: dict[str, Any] = payload["error"]
    return error
