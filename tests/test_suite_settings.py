"""The suite's own settings (tests/conftest.py) hold in every test module: a Hypothesis example
has no deadline, so a loaded machine cannot fail a property that holds; a test that needs a
redis-server skips without one, and fails under CI, where it must have been installed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]


def test_hypothesis_examples_have_no_deadline() -> None:
    assert settings.default is not None and settings.default.deadline is None
    assert settings(max_examples=3).deadline is None, "a test's own settings inherit it"


@settings(max_examples=2)
@given(st.integers())
def test_an_example_slower_than_hypothesis_default_deadline_passes(_: int) -> None:
    time.sleep(0.25)  # Hypothesis's default deadline is 200 ms


# A test of each of the conftest's Redis fixtures, one per server kind.
_REDIS_TESTS = [
    "tests/cachesvc/kv/tiers/test_redis_tier.py::test_round_trip_prefix_and_namespaces",
    "tests/cachesvc/kv/test_events_redis.py::test_publisher_rides_out_a_redis_outage",
]


def _run_without_redis_server(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    """Run the Redis tests in a pytest of their own whose PATH holds no redis-server."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(tmp_path)  # an empty folder: no redis-server on it
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_REDIS_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_missing_redis_server_skips_its_tests_but_fails_them_under_ci(tmp_path: Path) -> None:
    here = _run_without_redis_server(tmp_path, ci=False)
    assert here.returncode == 0 and "2 skipped" in here.stdout, here.stdout[-2000:]
    ci = _run_without_redis_server(tmp_path, ci=True)
    assert ci.returncode == 1 and "2 errors" in ci.stdout, ci.stdout[-2000:]
    assert "redis-server is not installed" in ci.stdout
    assert "CI must install it" in ci.stdout
