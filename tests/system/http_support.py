"""The HTTP door beside a test router: started on the router's own loop, on a free port."""

from __future__ import annotations

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
