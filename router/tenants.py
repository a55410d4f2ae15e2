"""Tenants and their bearer tokens: the names, the tokens file, and how both are checked.

A tenant's calls share a cache of their own (its salt); `router.auth` maps a token to its
tenant. Read once, at start (`load_tenant_tokens`), by the CLI and the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cachesvc.kv.config import ConfigError

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class TenantToken:
    """A bearer token that authenticates `tenant`; a tenant's calls share a cache of their own."""

    tenant: str
    token: str = field(repr=False)


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
    """The tenants of a tenant tokens file's text: one `TENANT TOKEN` per line; blank lines and
    lines starting with `#` are skipped. A ConfigError names `source` and the line."""
    entries: list[TenantToken] = []
    lines: dict[str, tuple[int, str]] = {}  # token -> (line number, tenant)
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number}"
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(
                f"{where}: expected 'TENANT TOKEN' (two fields), got {len(parts)} fields"
            )
        tenant, token = parts
        check_tenant_token(tenant, token, where)
        if token in lines:
            first, other = lines[token]
            raise ConfigError(
                f"{where}: tenant {tenant!r} has the token of tenant {other!r} (line {first}): "
                "give every tenant a token of its own"
            )
        lines[token] = (number, tenant)
        entries.append(TenantToken(tenant, token))
    return tuple(entries)


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
