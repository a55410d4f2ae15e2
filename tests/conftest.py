"""Suite-wide settings: never reach a model hub, keep torch to the machine's cores, give
Hypothesis examples no deadline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import settings  # noqa: E402

# An example's wall time says how busy the machine is, not whether the property holds: no
# deadline (Hypothesis's default of 200 ms fails quick examples on a loaded machine). Loaded
# here, before any test module makes its own settings, which inherit it.
settings.register_profile("cachesvc", deadline=None)
settings.load_profile("cachesvc")


# ---- a real redis-server, started once per session on a free loopback port ----------------------

import contextlib  # noqa: E402
import signal  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from suite_support import require_redis_server  # noqa: E402

from cachesvc.bench.local_redis import LocalRedis, local_redis  # noqa: E402


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a throwaway redis-server (no persistence); tests isolate by key namespace."""
    require_redis_server()
    with local_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def fresh_redis_url(redis_url: str) -> str:
    """The session's Redis, emptied: this test's keys only."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    return redis_url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of this test alone, which it may stop, restart or freeze (SIGSTOP): it is
    thawed and stopped at the end whatever the test did to it."""
    require_redis_server()
    server = LocalRedis(tmp_path).start()
    yield server
    if server.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGCONT)  # a stopped server would not terminate
    server.stop()
