"""Cache controls on the completions and chat endpoints.

OpenAI's: `prompt_cache_key` (a string of at most `MAX_AFFINITY_KEY_LEN` characters: requests
with the same key belong together, routed to one worker while it is within bounds:
`GenerateInput.affinity_key`) and `prompt_cache_retention` (`in_memory`, the default: no
retention, or `24h`: the prompt's blocks are retained for a day, soft, within the tenant's
limits: `GenerateInput.retention_s`).

Our extensions, beside them at the top level of the body: `cache_session_id` (tags the retained
blocks with a conversation; `DELETE /v1/cache/sessions/{id}` ends it), `skip_cache_read` and
`skip_cache_write` (reuse no cached KV, and no stored answer; cache nothing computed, and store
no answer) and `cache_explain` (a bool, or the `x-cache-explain: 1` header: where each part
of the prompt came from, `usage.cache_explanation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.domain import MAX_AFFINITY_KEY_LEN
from router.http.fields import check, shown, typed
from router.request.cache_hints import check_session_id

# OpenAI's retentions -> seconds asked (None: the default, kept as long as the pool keeps it).
RETENTIONS: dict[str, int | None] = {"in_memory": None, "24h": 24 * 3600}
FIELDS = (
    "prompt_cache_key",
    "prompt_cache_retention",
    "cache_session_id",
    "skip_cache_read",
    "skip_cache_write",
    "cache_explain",
)


@dataclass(frozen=True)
class CacheControls:
    affinity_key: str | None = None
    retention_s: int | None = None
    session_id: str | None = None
    skip_read: bool = False
    skip_write: bool = False
    explain: bool = False


def parse_cache_controls(body: dict[str, Any]) -> CacheControls:
    """The body's cache controls; raises InvalidInput naming the field."""
    return CacheControls(
        affinity_key=parse_affinity_key(body),
        retention_s=parse_retention(body),
        session_id=parse_session_id(body),
        skip_read=typed(body, "skip_cache_read", bool, False),
        skip_write=typed(body, "skip_cache_write", bool, False),
        explain=typed(body, "cache_explain", bool, False),
    )


def parse_affinity_key(body: dict[str, Any]) -> str | None:
    key = typed(body, "prompt_cache_key", str, None)
    check(
        key is None or len(key) <= MAX_AFFINITY_KEY_LEN,
        f"prompt_cache_key must be at most {MAX_AFFINITY_KEY_LEN} characters, got {len(key or '')}",
    )
    return key or None


def parse_retention(body: dict[str, Any]) -> int | None:
    retention = body.get("prompt_cache_retention")
    check(
        retention is None or (isinstance(retention, str) and retention in RETENTIONS),
        f"prompt_cache_retention must be 'in_memory' or '24h', got {shown(retention)}",
    )
    return None if retention is None else RETENTIONS[retention]


def parse_session_id(body: dict[str, Any]) -> str | None:
    return check_session_id(typed(body, "cache_session_id", str, None), "cache_session_id")


def explain_header(value: str | None) -> bool:
    """The `x-cache-explain` header: "1" or "true" asks an explanation; absent, "0" or "false"
    does not; anything else raises InvalidInput naming the header."""
    if value is None:
        return False
    text = value.strip().lower()
    check(text in ("1", "true", "0", "false"), f"x-cache-explain must be 1 or 0, got {value!r}")
    return text in ("1", "true")
