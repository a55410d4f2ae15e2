"""Errors of the HTTP door, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
with the HTTP status an OpenAI client expects (its SDK picks the exception class by status)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from router.domain import Exhausted, InvalidInput, RouterError, Unavailable, Unimplemented


@dataclass(frozen=True)
class HttpError(Exception):
    """A refusal of the HTTP door itself (auth, body, unknown model), raised before the core."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None


# The router core's errors, as gRPC maps them to a status: the same meaning on this door.
_STATUSES: dict[type[RouterError], tuple[int, str, str | None]] = {
    InvalidInput: (400, "invalid_request_error", None),
    Exhausted: (429, "rate_limit_error", "rate_limit_exceeded"),
    Unavailable: (503, "service_unavailable_error", "service_unavailable"),
    Unimplemented: (501, "not_implemented_error", "not_implemented"),
}

# A gRPC-style name per HTTP status, for the requests metric (both doors count alike).
STATUS_NAMES = {
    200: "OK",
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
}


def from_router_error(exc: BaseException) -> HttpError:
    """The HTTP error of an exception out of the router core (anything else is a 500 that
    names only the exception's class: its text may hold internals)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RouterError):
        status, kind, code = _STATUSES.get(type(exc), (500, "server_error", None))
        param = param_of(str(exc)) if status == 400 else None
        return HttpError(status, str(exc), kind, code, param)
    return HttpError(500, f"internal error: {type(exc).__name__}", "server_error")


# A refusal's message starts with the field it is about ("max_tokens must be >= 1",
# "messages[0].role must be ...", "logprobs is not supported ..."): OpenAI's `param`.
_FIELD = re.compile(
    r"^([A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*)(?: is | are | must |: )"
)


def param_of(message: str) -> str | None:
    """The request field a refusal's message names first, None when it names none."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def error_body(err: HttpError) -> bytes:
    """The JSON body OpenAI sends with an error status."""
    payload = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    return json.dumps({"error": payload}).encode()
