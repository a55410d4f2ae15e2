"""The HTTP door's server: uvicorn on the router's own event loop, beside the gRPC server.

Started and stopped by whoever starts the gRPC server (`router.bootstrap.serve_until_signal`);
it never installs signal handlers (the caller owns them) nor touches logging. Over TLS, with
the same files as the gRPC port, when the config has a certificate.
"""

from __future__ import annotations

import ssl

import uvicorn

from router.auth import TokenTable
from router.config import RouterConfig
from router.core import Router
from router.http.app import OpenAIDoor


class HttpServer:
    """The OpenAI-compatible endpoints of a started Router on `host:port` (0: any free port;
    `port` is the one bound once started)."""

    def __init__(self, router: Router, config: RouterConfig, port: int, model_name: str) -> None:
        self.door = OpenAIDoor(router, model_name, TokenTable.from_config(config))
        tls: dict[str, object] = {}
        if config.tls_cert_file is not None:
            tls = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
            if config.tls_client_ca_file is not None:
                tls["ssl_ca_certs"] = config.tls_client_ca_file
                tls["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(
                self.door.app,
                host=config.host,
                port=port,
                lifespan="off",
                log_config=None,
                access_log=False,
                server_header=False,
                date_header=False,
                **tls,  # type: ignore[arg-type]
            )
        )
        self.port = port
        self.tls = bool(tls)

    async def start(self) -> None:
        """Listen; raises OSError when the port cannot be bound."""
        server = self._uvicorn
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        try:
            await server.startup()
        except SystemExit as exc:  # uvicorn exits on a bind error (and has logged it)
            raise OSError(f"cannot listen on {server.config.host}:{server.config.port}") from exc
        self.port = server.servers[0].sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Answer 503 to health checks, let running requests finish for `grace_s`, then stop."""
        self.door.closing = True
        self._uvicorn.config.timeout_graceful_shutdown = max(1, round(grace_s))
        self._uvicorn.should_exit = True
        await self._uvicorn.shutdown()
