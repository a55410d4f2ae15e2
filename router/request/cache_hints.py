"""A request's explicit cache controls: their checks, and the hints its worker is given.

The doors parse the controls (`session_id`, `retention_s`, `retention_tokens`, skip read or
write) into `GenerateInput`; the core checks the retention against the tenant's limit
(`check_retention`) and hands each worker call `cache_hints(req)`. A request without controls
gives the default hints, which are not sent at all (an older worker still answers).
"""

from __future__ import annotations

from router.domain import MAX_SESSION_ID_LEN, GenerateInput, InvalidInput
from router.tenants import MAX_RETENTION_S, QuotaTable
from workers.protocol import CacheHints


def check_session_id(value: str | None, field: str = "session_id") -> str | None:
    """A session id as a request gives it ("" or None: none); InvalidInput naming `field`
    unless it is at most `MAX_SESSION_ID_LEN` printable characters."""
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_LEN:
        raise InvalidInput(f"{field} is {len(value)} characters; at most {MAX_SESSION_ID_LEN}")
    if not value.isprintable():
        raise InvalidInput(f"{field} must be printable characters (no control characters)")
    return value


def check_retention_s(seconds: int, field: str = "retention_s") -> int | None:
    """A retention asked, in [0, MAX_RETENTION_S] seconds; 0 is none (None)."""
    if not 0 <= seconds <= MAX_RETENTION_S:
        raise InvalidInput(f"{field} must be in [0, {MAX_RETENTION_S}] seconds, got {seconds}")
    return seconds or None


def check_retention(quotas: QuotaTable, tenant: str, retention_s: int | None) -> None:
    """InvalidInput naming retention_s when the tenant may not ask that long a retention."""
    if not retention_s:
        return
    longest = quotas.limits(tenant).max_retention_s
    if retention_s > longest:
        whose = f"tenant {tenant!r}" if tenant else "requests without a tenant's token"
        allowed = f"at most {longest} s" if longest else "none"
        raise InvalidInput(
            f"retention_s of {retention_s} s is over the limit of {whose}: {allowed} "
            "(its quota's max_retention_s)"
        )


def cache_hints(req: GenerateInput) -> CacheHints:
    """What the worker is told of the request's cache controls."""
    return CacheHints(
        retention_s=req.retention_s or 0,
        retention_tokens=req.retention_tokens,
        tenant=req.tenant,
        session_id=req.session_id,
        skip_read=req.skip_cache_read,
        skip_write=req.skip_cache_write,
    )
