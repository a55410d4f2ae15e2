"""OpenAI's prompt cache controls on the completions and chat endpoints: `prompt_cache_key`
(a string of at most `MAX_AFFINITY_KEY_LEN` characters: requests with the same key belong
together, routed to one worker while it is within bounds: `GenerateInput.affinity_key`) and
`prompt_cache_retention` (`in_memory`, the default, or `24h`: `GenerateInput.retention_s`).
The retention is a hint, carried but not yet honoured by eviction. Our extension beside them,
`cache_explain` (a bool, or the `x-cache-explain: 1` header): answer where each part of the prompt
came from (`usage.cache_explanation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.domain import MAX_AFFINITY_KEY_LEN
from router.http.fields import check, shown, typed

# OpenAI's retentions -> seconds asked (None: the default, kept as long as the pool keeps it).
RETENTIONS: dict[str, int | None] = {"in_memory": None, "24h": 24 * 3600}
FIELDS = ("prompt_cache_key", "prompt_cache_retention", "cache_explain")


@dataclass(frozen=True)
class CacheControls:
    affinity_key: str | None = None
    retention_s: int | None = None
    explain: bool = False


def parse_cache_controls(body: dict[str, Any]) -> CacheControls:
    """The body's cache controls; raises InvalidInput naming the field."""
    key = typed(body, "prompt_cache_key", str, None)
    check(
        key is None or len(key) <= MAX_AFFINITY_KEY_LEN,
        f"prompt_cache_key must be at most {MAX_AFFINITY_KEY_LEN} characters, got {len(key or '')}",
    )
    retention = body.get("prompt_cache_retention")
    check(
        retention is None or (isinstance(retention, str) and retention in RETENTIONS),
        f"prompt_cache_retention must be 'in_memory' or '24h', got {shown(retention)}",
    )
    return CacheControls(
        key or None,
        None if retention is None else RETENTIONS[retention],
        explain=typed(body, "cache_explain", bool, False),
    )


def explain_header(value: str | None) -> bool:
    """The `x-cache-explain` header: "1" or "true" asks an explanation; absent, "0" or "false"
    does not; anything else raises InvalidInput naming the header."""
    if value is None:
        return False
    text = value.strip().lower()
    check(text in ("1", "true", "0", "false"), f"x-cache-explain must be 1 or 0, got {value!r}")
    return text in ("1", "true")
