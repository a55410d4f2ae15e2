"""Reading a JSON request body's fields, for every endpoint of the HTTP door: each refusal is
InvalidInput whose message starts with the field it is about (`errors.param_of` finds it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from router.domain import InvalidInput

# Fields named in a refusal are cut to this many characters (a body may be megabytes).
SHOWN_CHARS = 64


def json_object(value: Any, field: str = "the request body") -> dict[str, Any]:
    """`value` as an object; InvalidInput naming `field` otherwise."""
    if not isinstance(value, dict):
        raise InvalidInput(f"{field} must be a JSON object")
    return value


def typed(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """`body[name]` of type `kind`; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidInput(f"{prefix}{name} must be a {KINDS[kind]}, got {json_kind(value)}")
    return value


def integer(body: dict[str, Any], name: str, default: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type; 16.0 is 16
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an integer, got {json_kind(value)}")
    return value


def number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
        raise InvalidInput(f"{name} must be a finite number, got {json_kind(value)}")
    return float(value)


def finite(value: int | float) -> bool:
    """Whether a JSON number is a finite double (an integer past 1.8e308 is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


KINDS = {bool: "boolean", str: "string", int: "integer", float: "number"}


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number" if finite(value) else "non-finite number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidInput(message)


def shown(value: Any) -> str:
    """A value as a refusal quotes it: a short string itself, anything else its kind."""
    if isinstance(value, str) and len(value) <= SHOWN_CHARS:
        return repr(value)
    return "a long string" if isinstance(value, str) else json_kind(value)


def shown_name(name: str) -> str:
    """A field's name as a refusal quotes it: cut to `SHOWN_CHARS`."""
    return name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS] + "..."


# A field this server does not serve is still accepted with a value that asks for nothing:
# the test of that value, given the whole body (`best_of` is neutral when it equals `n`).
Neutral = Mapping[str, Callable[[Any, dict[str, Any]], bool]]


def check_fields(
    body: dict[str, Any], known: frozenset[str], neutral: Neutral | None = None, prefix: str = ""
) -> None:
    """Refuse a field outside `known` unless its value asks for nothing: null, false, an empty
    string, list or object, or a value its `neutral` test passes."""
    for name, value in body.items():
        if name in known or value is None or value is False or value in ("", [], {}):
            continue
        test = (neutral or {}).get(name)
        if test is not None and test(value, body):
            continue
        raise InvalidInput(f"{prefix}{shown_name(name)} is not supported by this server")


def stop_strings(stops: Any, field: str, limit: int, expected: str) -> tuple[str, ...]:
    """A list of at most `limit` non-empty stop strings, or InvalidInput naming `field` (the
    message says the field must be `expected`)."""
    check(
        isinstance(stops, list) and all(isinstance(s, str) for s in stops),
        f"{field} must be {expected}",
    )
    check(len(stops) <= limit, f"{field} has {len(stops)} strings; at most {limit}")
    for i, s in enumerate(stops):
        check(bool(s), f"{field}[{i}] must not be empty")
    return tuple(stops)
