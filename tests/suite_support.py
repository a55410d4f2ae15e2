"""What tests anywhere in the suite share: a tool a test needs that is not installed (a skip on
a developer's machine, a failure under CI), and waiting until a condition holds."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

import pytest

from cachesvc.bench.local_redis import redis_server_binary


def unavailable(reason: str) -> NoReturn:
    """Skip the test for want of what `reason` names; under CI (the CI variable set) fail it
    instead: there the tool must have been installed, and a broken install must not pass as a
    run whose tests were skipped."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must install it: see .ci/run)")
    pytest.skip(reason)


def require_redis_server() -> None:
    """Return when `redis-server` is installed; else `unavailable`."""
    if redis_server_binary() is None:
        unavailable("redis-server is not installed (apt-get install redis-server)")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` until it holds; fails naming `what` after `timeout_s` (a bound on a hang,
    not a measure of speed: give it ample room)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.05)
