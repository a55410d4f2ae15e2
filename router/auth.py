"""Bearer-token authentication for every RPC except health checks.

With a token configured, a call needs the metadata `authorization: Bearer <token>`; anything
else ends with UNAUTHENTICATED before the servicer runs. Health checks stay open so load
balancers and orchestrators can probe without the secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_DENIED = "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'"


def parse_bearer(value: str | bytes | None) -> str | None:
    """The token in an `authorization` value such as "Bearer abc"; None if absent or another
    scheme. The scheme is case-insensitive (RFC 7235); the token is not."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def is_authorized(expected: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """True when the first `authorization` entry carries `expected` (compared in constant time)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            token = parse_bearer(value)
            return token is not None and hmac.compare_digest(token.encode(), expected.encode())
    return False


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects calls without the configured bearer token (health checks excepted)."""

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        if not token:
            raise ValueError("an empty bearer token would let anyone in")
        self._token = token
        self._open = tuple(open_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.startswith(self._open) or is_authorized(
            self._token, handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _denying(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only says UNAUTHENTICATED."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)
