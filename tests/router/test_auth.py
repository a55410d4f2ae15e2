"""Bearer-token parsing and matching, as tables."""

from __future__ import annotations

import pytest

from router.auth import BearerTokenInterceptor, is_authorized, parse_bearer


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
        (b"Bearer abc", "abc"),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic abc", None),
        ("abc", None),
        ("Bearer a b", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_bearer(value: str | bytes | None, token: str | None) -> None:
    assert parse_bearer(value) == token


@pytest.mark.parametrize(
    ("metadata", "ok"),
    [
        ([("authorization", "Bearer s3cret")], True),
        ([("Authorization", "Bearer s3cret")], True),
        ([("x-other", "1"), ("authorization", "Bearer s3cret")], True),
        ([("authorization", "Bearer S3CRET")], False),  # tokens are case-sensitive
        ([("authorization", "Bearer s3cret-and-more")], False),
        ([("authorization", "Basic s3cret")], False),
        ([("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")], False),
        ([("x-token", "s3cret")], False),
        ([], False),
        (None, False),
    ],
)
def test_is_authorized(metadata: list[tuple[str, str]] | None, ok: bool) -> None:
    assert is_authorized("s3cret", metadata) is ok


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        BearerTokenInterceptor("")
