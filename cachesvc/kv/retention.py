"""Retention: what a request asks the cache to keep of its prompt, and how long.

Retention is soft (as TensorRT-LLM's retention priorities and SGLang's priority eviction, not a
hard pin): a retained block is evicted after every unretained block of its store, lower classes
before higher ones, least recently used first within a class, until its retention expires; then
it is an ordinary block again. A tenant's retained blocks are bounded per store by its retention
budget; past it, that tenant's own oldest retention is demoted, never another tenant's, and the
request is still served (the trim is reported in its usage).

A `Retention` travels with its block when the block moves down a tier, so the tier below keeps
the same order; the expiry is wall-clock time, so it survives a restart where the tier does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Retention classes: 0 is no retention (the default). Anthropic's 5-minute and 1-hour TTLs and
# OpenAI's `in_memory` are short; OpenAI's `24h` is long. A longer retention outlives a shorter
# one under pressure: the short class is evicted first.
NO_RETENTION = 0
SHORT = 1
LONG = 2
NUM_CLASSES = 3
LONG_FROM_S = 3600  # retentions longer than this are of the long class


def retention_class(seconds: float) -> int:
    """The class of a retention of `seconds` (0 or less: none)."""
    if seconds <= 0:
        return NO_RETENTION
    return LONG if seconds > LONG_FROM_S else SHORT


@dataclass(frozen=True)
class Retention:
    """A block's retention: its class, when it ends (wall clock, `time.time()`), and whose
    budget it counts against. `session` ties it to a conversation that may end it early."""

    cls: int
    expires_at: float
    tenant: str = ""
    session: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.cls < NUM_CLASSES:
            raise ValueError(f"retention class must be in [1, {NUM_CLASSES}), got {self.cls}")
        if math.isnan(self.expires_at):
            raise ValueError("retention expiry must be a time, got NaN")

    @classmethod
    def for_seconds(
        cls, seconds: float, now: float, tenant: str = "", session: str | None = None
    ) -> Retention | None:
        """The retention of `seconds` from `now`; None for no retention (0 or less)."""
        klass = retention_class(seconds)
        if klass == NO_RETENTION:
            return None
        return cls(klass, now + seconds, tenant, session)

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def merge(self, other: Retention) -> Retention:
        """One block retained twice keeps the stronger claim: the higher class and the later
        expiry; the tenant and session of the later-ending one."""
        last = self if self.expires_at >= other.expires_at else other
        return Retention(max(self.cls, other.cls), last.expires_at, last.tenant, last.session)
