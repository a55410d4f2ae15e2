"""A request's body: read within a limit, decoded as strict JSON, its text checked.

JSON over HTTP is UTF-8 (RFC 8259), so the bytes are decoded as such; `NaN` and `Infinity`
are not JSON and are refused (Python's decoder would take them). A `\\ud800` escape decodes to
a lone surrogate, a string no encoder takes: every string of the body, and every key, is
checked once here, so nothing downstream (tokenizer, hashing, headers, logs) meets one. Deep
nesting is refused by the decoder's recursion limit, and the walk is iterative.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from router.domain import InvalidInput
from router.http.errors import HttpError

# As gRPC's default limit on a received message: the largest prompt either door takes.
MAX_BODY_BYTES = 4 * 2**20
# A lone surrogate can only come from an escape in the text (the UTF-8 decoder refuses an
# encoded one): bodies without such an escape are not walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


async def read_json(request: Request) -> Any:
    """The body as JSON. Raises HttpError 413 past `MAX_BODY_BYTES` (before reading when the
    length is declared), 400 when it is not UTF-8 JSON; InvalidInput naming the field of a
    string that holds a lone surrogate; ClientGone when the client hangs up while sending."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large(size)
            parts.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        text = b"".join(parts).decode("utf-8")
        body = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:
        raise HttpError(400, f"the request body is not valid JSON: {exc}"[:200]) from None
    if _SURROGATE_ESCAPE.search(text):
        _check_text(body)
    return body


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_text(body: Any) -> None:
    """Raise InvalidInput naming the first string (or the object holding the first key) with
    a lone surrogate."""
    if not isinstance(body, dict | list):
        return  # not an object: refused as such
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            if any(_SURROGATE.search(key) for key in value):
                raise _not_text(path or "the request body", "one of its keys")
            children = [(f"{path}.{key}" if path else key, v) for key, v in value.items()]
        else:  # a list: numbers need no name (a prompt may be a million token ids)
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value) if _may_hold_text(v)]
        for child_path, child in children:
            if isinstance(child, str) and _SURROGATE.search(child):
                raise _not_text(child_path, "it")
        stack.extend(reversed([(p, c) for p, c in children if isinstance(c, dict | list)]))


def _may_hold_text(value: Any) -> bool:
    return isinstance(value, str | dict | list)


def _not_text(field: str, what: str) -> InvalidInput:
    return InvalidInput(
        f"{field} must be valid Unicode text: {what} holds a lone surrogate "
        "(an unpaired \\ud800-\\udfff escape)"
    )


def _too_large(size: int) -> HttpError:
    return HttpError(
        413, f"the request body has {size}+ bytes; at most {MAX_BODY_BYTES}", code="too_large"
    )
