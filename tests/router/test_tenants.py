"""The tenants file's limits (`share=`, `max_retention=`, `retention_share=`), the quota table
the router keeps of them, and the retention check a request passes."""

from __future__ import annotations

import pytest

from cachesvc.kv.config import ConfigError
from router.domain import InvalidInput
from router.request.cache_hints import check_retention
from router.tenants import (
    MAX_RETENTION_S,
    QuotaTable,
    TenantLimits,
    TenantToken,
    parse_retention,
    parse_tenant_tokens,
)
from workers.protocol import TenantQuota


def test_limits_follow_the_token_and_reach_every_line_of_the_tenant() -> None:
    text = (
        "acme a-tok share=0.5 max_retention=1h retention_share=0.25\n"
        "umbrella u-tok\n"
        "acme a-tok-2\n"  # another token of acme's: the same limits
        "initech i-tok max_retention=300\n"
    )
    entries = parse_tenant_tokens(text, "f")
    acme = TenantLimits(share=0.5, max_retention_s=3600, retention_share=0.25)
    assert entries == (
        TenantToken("acme", "a-tok", acme),
        TenantToken("umbrella", "u-tok"),
        TenantToken("acme", "a-tok-2", acme),
        TenantToken("initech", "i-tok", TenantLimits(max_retention_s=300)),
    )
    table = QuotaTable.of_tokens(entries)
    assert table.limits("acme") == acme
    assert table.limits("umbrella") == TenantLimits()  # no entry: the defaults
    assert table.for_workers() == {
        "acme": TenantQuota(share=0.5, retention_share=0.25),
        "initech": TenantQuota(share=1.0, retention_share=TenantQuota().retention_share),
    }


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("0", 0), ("90", 90), ("90s", 90), ("5m", 300), ("1h", 3600), ("24h", 86400)],
)
def test_retentions_are_seconds_or_durations(value: str, seconds: int) -> None:
    assert parse_retention(value) == seconds


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("acme t share=0", r"f line 1: share must be in \(0, 1\], got 0"),
        ("acme t share=1.5", r"f line 1: share must be in \(0, 1\]"),
        ("acme t share=nan", r"f line 1: share must be in \(0, 1\]"),
        ("acme t share=half", "f line 1: share must be a number, got 'half'"),
        ("acme t retention_share=-0.1", r"f line 1: retention_share must be in \[0, 1\]"),
        ("acme t max_retention=2d", "f line 1: max_retention must be seconds or a duration"),
        (
            "acme t max_retention=25h",
            rf"f line 1: max_retention must be in \[0, {MAX_RETENTION_S}\]",
        ),
        ("acme t quota=1", "f line 1: 'quota' is no limit"),
        ("acme t share=1 share=1", "f line 1: share is given twice"),
        ("acme t x\nacme u share=0.5", "f line 1: field 3 is not key=value"),
        (
            "acme t share=0.5\nacme u share=0.25",
            "f line 2: tenant 'acme' has other limits on line 1",
        ),
    ],
)
def test_bad_limits_name_the_line_and_field(line: str, error: str) -> None:
    with pytest.raises(ConfigError, match=f"^{error}"):
        parse_tenant_tokens(line + "\n", "f")


def test_a_tenant_past_its_retention_limit_is_refused_naming_retention_s() -> None:
    table = QuotaTable([("acme", TenantLimits(max_retention_s=300)), ("", TenantLimits(0.5, 0))])
    check_retention(table, "acme", 300)
    check_retention(table, "acme", None)
    with pytest.raises(InvalidInput, match="^retention_s of 3600 s is over the limit"):
        check_retention(table, "acme", 3600)
    with pytest.raises(InvalidInput, match="^retention_s .* without a tenant's token: none"):
        check_retention(table, "", 1)
    check_retention(table, "umbrella", MAX_RETENTION_S)  # no entry: a day is allowed
    table.set("umbrella", TenantLimits(max_retention_s=60))
    with pytest.raises(InvalidInput, match="tenant 'umbrella': at most 60 s"):
        check_retention(table, "umbrella", 61)
