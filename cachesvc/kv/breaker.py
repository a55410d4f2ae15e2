"""A circuit breaker for a remote tier: after enough failures in a row, stop calling it for a
while, then let one call probe it.

closed ──(`max_failures` failures in a row)──► open ──(`cooldown_s` passed)──► half-open
  ▲                                              ▲                                │
  └───────────── the probe succeeded ────────────┼──────── the probe failed ──────┘

While open every call is skipped (a miss, no network); half-open lets exactly one call through,
whichever thread asks first. So a Redis that stops answering costs `max_failures` timeouts, then
one per cool-down, however many requests arrive meanwhile. Thread-safe; the clock is injectable
for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Whether to call a remote now (`allow`), told how each allowed call went."""

    def __init__(
        self,
        max_failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or cooldown_s < 0:
            raise ValueError("max_failures must be >= 1 and cooldown_s >= 0")
        self.max_failures = max_failures
        self.cooldown_s = cooldown_s
        self.num_opens = 0
        self._clock = clock
        self._failures = 0  # in a row
        self._open_until: float | None = None  # None: closed
        self._probing = False  # half-open, and the probe has been let through
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return CLOSED
            return HALF_OPEN if self._probing or self._clock() >= self._open_until else OPEN

    def allow(self) -> bool:
        """May the caller touch the remote now? Every True must be followed by `succeeded` or
        `failed`: in half-open it hands out the one probe."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._probing = False

    def failed(self) -> bool:
        """Count a failed call; True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._open_until is not None and not self._probing:
                return False  # a call that started before it opened: already open
            if self._probing or self._failures >= self.max_failures:
                self._open_until = self._clock() + self.cooldown_s
                self._probing = False
                self.num_opens += 1
                return True
            return False
