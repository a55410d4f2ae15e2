"""Suite-wide settings: never reach a model hub, keep torch to the machine's cores."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- a real redis-server, started once per session on a free loopback port ----------------------

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from cachesvc.bench.local_redis import local_redis, redis_server_binary  # noqa: E402


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a throwaway redis-server (no persistence); tests isolate by key namespace."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with local_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
