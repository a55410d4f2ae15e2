"""Errors of the HTTP door: a refusal names its field in OpenAI's `param` as well as in its
message, and the router core's errors keep their status."""

from __future__ import annotations

import json

import pytest

from router.domain import Exhausted, InvalidInput
from router.http.errors import error_body, from_router_error, param_of


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("max_tokens must be >= 1, got -1", "max_tokens"),
        ("logprobs is not supported by this server", "logprobs"),
        ("messages[0].role must be a non-empty string", "messages[0].role"),
        ("prompt[1] must be a string or a non-empty array of token ids", "prompt[1]"),
        ("stream_options is allowed only when stream is true", "stream_options"),
        ("the request body is not valid JSON: Expecting value", None),
        ("too many requests in flight", None),
    ],
)
def test_a_refusal_names_its_field(message: str, param: str | None) -> None:
    assert param_of(message) == param


def test_core_errors_keep_their_status_and_name_the_field() -> None:
    bad = from_router_error(InvalidInput("temperature must be >= 0, got -1"))
    body = json.loads(error_body(bad))["error"]
    assert bad.status == 400 and body["param"] == "temperature"
    assert body["type"] == "invalid_request_error" and "temperature" in body["message"]
    busy = from_router_error(Exhausted("too many requests in flight"))
    assert busy.status == 429 and busy.param is None
    hidden = from_router_error(RuntimeError("a secret path /x/y"))
    assert hidden.status == 500 and "/x/y" not in hidden.message
