"""What every servicer of the gRPC edge shares: bodies parsed leniently, errors mapped to one
status each, and the tenant a call's token names.

Request bodies are parsed here rather than by grpc, so a body that is not the expected message
is an INVALID_ARGUMENT like any other bad input (grpc itself would answer INTERNAL).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from router.auth import TokenTable
from router.domain import (
    Exhausted,
    InvalidInput,
    RequestFailed,
    RouterError,
    Unavailable,
    Unimplemented,
)
from router.grpc import wire

_log = logging.getLogger("router.grpc.server")

_CODES: dict[type[RouterError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    RequestFailed: grpc.StatusCode.INTERNAL,
}


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """Stands for a request body that did not parse; `reason` says why, naming the message
    type and, where it can be told, the field."""

    reason: str


def lenient(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeWarning):
            return Undecodable(wire.undecodable_reason(cls.DESCRIPTOR, data))

    return parse


def unary(fn: Any, req: type[Message], resp: type[Message]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=lenient(req), response_serializer=resp.SerializeToString
    )


def status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, RouterError):
        return _CODES.get(type(exc), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.INTERNAL


async def fail(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    if isinstance(exc, RouterError):
        await context.abort(status_of(exc), str(exc))
    _log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    raise AssertionError("unreachable")  # context.abort always raises


async def decoded(request: Any, context: grpc.aio.ServicerContext) -> Any:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
    return request


def caller_tenant(tokens: TokenTable | None, context: grpc.aio.ServicerContext) -> str | None:
    """The tenant the call's token names; None for the operator's, or without authentication."""
    if tokens is None:
        return None
    caller = tokens.caller(context.invocation_metadata())
    assert caller is not None, "the BearerTokenInterceptor lets only known tokens through"
    return caller.tenant
