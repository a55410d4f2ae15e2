"""Tenants, their bearer tokens and quotas: the names, the tokens file, and how all are checked.

A tenant's calls share a cache of their own (its salt); `router.auth` maps a token to its
tenant. Read once, at start (`load_tenant_tokens`), by the CLI and the config. A line of the
file may follow `TENANT TOKEN` with the tenant's limits, `key=value` each: `share=F` (its soft
share of each tier, 0 < F <= 1), `max_retention=SECONDS` (or `5m`, `1h`, `24h`: the longest
retention its requests may ask) and `retention_share=F` (the share of each tier its retained
blocks may take, 0 <= F <= 1). The router keeps them in a `QuotaTable` (Admin.SetTenantQuota
replaces an entry) and hands each worker their `workers.protocol.TenantQuota` form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cachesvc.kv.config import ConfigError
from workers.protocol import TenantQuota

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_RETENTION_S = 24 * 3600  # the longest retention a client may ask (OpenAI's `24h`)
_DURATION = re.compile(r"(\d{1,9})([smh]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quota: its soft `share` of each tier, in (0, 1] (1: none); the longest
    retention its requests may ask (`max_retention_s`, 0: none at all); the share of each tier
    its retained blocks may take (`retention_share`, in [0, 1]). Raises ValueError naming the
    field of a value out of range."""

    share: float = 1.0
    max_retention_s: int = MAX_RETENTION_S
    retention_share: float = TenantQuota().retention_share

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0 < self.share <= 1):
            raise ValueError(f"share must be in (0, 1], got {self.share:g}")
        if not 0 <= self.max_retention_s <= MAX_RETENTION_S:
            raise ValueError(
                f"max_retention must be in [0, {MAX_RETENTION_S}] seconds, "
                f"got {self.max_retention_s}"
            )
        if not (math.isfinite(self.retention_share) and 0 <= self.retention_share <= 1):
            raise ValueError(f"retention_share must be in [0, 1], got {self.retention_share:g}")

    def for_worker(self) -> TenantQuota:
        """What a worker's pools enforce (the retention limit is the router's alone)."""
        return TenantQuota(share=self.share, retention_share=self.retention_share)


class QuotaTable:
    """Tenant -> limits; "" stands for the requests without a tenant's token. A tenant without
    an entry has the default `TenantLimits()`. Mutated by `set` only."""

    def __init__(self, entries: Iterable[tuple[str, TenantLimits]] = ()) -> None:
        self._entries = dict(entries)

    @classmethod
    def of_tokens(cls, tokens: Iterable[TenantToken]) -> QuotaTable:
        """The limits the tenant tokens give (the checked config's: one per tenant)."""
        return cls((t.tenant, t.limits) for t in tokens if t.limits is not None)

    def limits(self, tenant: str) -> TenantLimits:
        return self._entries.get(tenant, TenantLimits())

    def set(self, tenant: str, limits: TenantLimits) -> None:
        self._entries[tenant] = limits

    def entries(self) -> dict[str, TenantLimits]:
        """The tenants with limits of their own (a copy)."""
        return dict(self._entries)

    def for_workers(self) -> dict[str, TenantQuota]:
        """The table in the workers' terms (`WorkerActor.set_quotas`)."""
        return {tenant: limits.for_worker() for tenant, limits in self._entries.items()}


def parse_retention(value: str) -> int:
    """Seconds of a retention written `SECONDS`, `Ns`, `Nm` or `Nh`; ValueError otherwise."""
    match = _DURATION.fullmatch(value)
    if match is None:
        raise ValueError(f"must be seconds or a duration such as 5m, 1h, 24h, got {value[:40]!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


@dataclass(frozen=True)
class TenantToken:
    """A bearer token that authenticates `tenant`; a tenant's calls share a cache of their own."""

    tenant: str
    token: str = field(repr=False)
    limits: TenantLimits | None = None  # None: the line set none (the defaults)


def check_tenant_token(tenant: str, token: str, where: str) -> None:
    """Raise a ConfigError (prefixed `where`) unless `tenant` is a valid name and `token` a
    usable bearer token. Errors never quote the token."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ConfigError(
            f"{where}: tenant name {tenant[:80]!r} must be 1-64 characters of A-Z a-z 0-9 _ . -"
        )
    # gRPC metadata values are printable ASCII; a token with anything else could never be sent.
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(
            f"{where}: the token of tenant {tenant!r} must be printable ASCII without spaces"
        )


def parse_tenant_tokens(text: str, source: str) -> tuple[TenantToken, ...]:
    """The tenants of a tenant tokens file's text: one `TENANT TOKEN [key=value ...]` per line;
    blank lines and lines starting with `#` are skipped. A ConfigError names `source`, the line
    and the field. A tenant's limits may be given on one of its lines, or alike on several."""
    entries: list[TenantToken] = []
    lines: dict[str, tuple[int, str]] = {}  # token -> (line number, tenant)
    limited: dict[str, tuple[int, TenantLimits]] = {}  # tenant -> (line number, limits)
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number}"
        parts = line.split()
        if len(parts) < 2:
            raise ConfigError(
                f"{where}: expected 'TENANT TOKEN' (two fields, then optional key=value "
                f"limits), got {len(parts)} fields"
            )
        tenant, token = parts[:2]
        check_tenant_token(tenant, token, where)
        limits = parse_limits(parts[2:], where) if parts[2:] else None
        if limits is not None:
            first_limits = limited.setdefault(tenant, (number, limits))
            if first_limits[1] != limits:
                raise ConfigError(
                    f"{where}: tenant {tenant!r} has other limits on line {first_limits[0]}: "
                    "give them on one line"
                )
        if token in lines:
            first, other = lines[token]
            raise ConfigError(
                f"{where}: tenant {tenant!r} has the token of tenant {other!r} (line {first}): "
                "give every tenant a token of its own"
            )
        lines[token] = (number, tenant)
        entries.append(TenantToken(tenant, token))
    return tuple(
        TenantToken(e.tenant, e.token, limited[e.tenant][1]) if e.tenant in limited else e
        for e in entries
    )


_LIMIT_FIELDS = ("share", "max_retention", "retention_share")


def parse_limits(fields: Iterable[str], where: str) -> TenantLimits:
    """A tokens file line's `key=value` limits; a ConfigError names `where` and the field."""
    values: dict[str, float | int] = {}
    for number, item in enumerate(fields, start=3):
        key, eq, value = item.partition("=")
        if not eq:  # not quoted: it may be part of a token written with a space
            raise ConfigError(
                f"{where}: field {number} is not key=value (a limit: "
                f"{', '.join(_LIMIT_FIELDS)}); a token must have no spaces"
            )
        if key not in _LIMIT_FIELDS:
            raise ConfigError(f"{where}: {key[:40]!r} is no limit: {', '.join(_LIMIT_FIELDS)} are")
        if key in values:
            raise ConfigError(f"{where}: {key} is given twice")
        try:
            values[key] = parse_retention(value) if key == "max_retention" else float(value)
        except ValueError as exc:
            reason = exc if key == "max_retention" else f"must be a number, got {value[:40]!r}"
            raise ConfigError(f"{where}: {key} {reason}") from None
    try:
        return TenantLimits(
            share=float(values.get("share", 1.0)),
            max_retention_s=int(values.get("max_retention", MAX_RETENTION_S)),
            retention_share=float(values.get("retention_share", TenantLimits.retention_share)),
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_tenant_tokens(path: str | Path) -> tuple[TenantToken, ...]:
    """The tenants of the tenant tokens file at `path` (reads it); see `parse_tenant_tokens`."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"--tenant-tokens-file: cannot read {path}: {reason}") from None
    entries = parse_tenant_tokens(text, f"tenant tokens file {path}")
    if not entries:
        raise ConfigError(
            f"tenant tokens file {path} has no tenants: add lines 'TENANT TOKEN', or drop "
            "--tenant-tokens-file"
        )
    return entries
