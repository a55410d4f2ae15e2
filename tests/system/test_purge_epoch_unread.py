"""Two routers share a Redis index; the second one's link to Redis freezes, and the first purges
meanwhile. The worker holds the prompt's blocks of the purged epoch again (cached after the purge
by a request that was under way). The second router cannot read the new epoch: it must not hash
under the one it read last, which would reuse those blocks, but serve the request without any
cached block (the same tokens, all computed), counting it; once its link is back it follows the
new epoch and shares blocks again."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from routing_support import tokens_and_usage
from slow_link import SlowLink

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig
from workers.protocol import StreamDelta

pytestmark = pytest.mark.system

NUM_BLOCKS = 8  # full blocks of each prompt (block size 4)


@pytest.fixture(scope="module")
def workers(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    import ray

    from workers.spawn import spawn_worker

    name = f"epoch-w0-{uuid.uuid4().hex[:6]}"
    actor = spawn_worker("w0", engine_config, name=name, num_cpus=0.5, max_restarts=0)
    yield {WorkerId("w0"): actor}
    ray.kill(actor)


def _cache_directly(actor: Any, prompt: list[int], salt: str | None) -> None:
    """What a request routed before the purge does after it: cache `prompt` under `salt`."""
    import ray

    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    stream = actor.generate.options(num_returns="streaming").remote(
        prompt, params, uuid.uuid4().hex, salt, None
    )
    assert all(isinstance(ray.get(ref), StreamDelta) for ref in stream)


def test_a_router_that_cannot_read_the_epoch_reuses_no_block(
    workers: dict[WorkerId, Any], start_router: Any, redis_url: str
) -> None:
    namespace = f"unread-{uuid.uuid4().hex[:8]}"
    with SlowLink(int(urlparse(redis_url).port or 0)) as link:
        first = start_router(workers, redis_url=redis_url, redis_namespace=namespace)
        second = start_router(workers, redis_url=link.url, redis_namespace=namespace)
        rng = random.Random(uuid.uuid4().int)
        prompt, later = ([rng.randrange(3, 300) for _ in range(NUM_BLOCKS * 4 + 2)] for _ in "ab")
        tokens, _ = tokens_and_usage(second, prompt)
        assert sum(tokens_and_usage(second, prompt)[1].cached_tokens.values()) == NUM_BLOCKS * 4

        link.freeze()
        admin = pb_grpc.AdminStub(first.channel())
        assert admin.Purge(pb.PurgeRequest()).num_blocks_purged["hbm"] >= NUM_BLOCKS
        for _ in range(2):  # reused once: the worker keeps them
            _cache_directly(workers[WorkerId("w0")], prompt, None)  # epoch 0's salt

        got, usage = tokens_and_usage(second, prompt)
        assert got == tokens
        assert sum(usage.cached_tokens.values()) == 0, dict(usage.cached_tokens)
        assert usage.computed_tokens == len(prompt)
        metrics = second.router.metrics.registry
        assert (metrics.get_sample_value("cachesvc_index_epoch_unknown_total") or 0) >= 1

        # Back: after the breaker's cool-down it reads the new epoch and shares blocks again
        # (the first request of a prompt under it computes, the next one reuses).
        link.thaw()
        deadline = time.monotonic() + 120
        while sum(tokens_and_usage(second, later)[1].cached_tokens.values()) < NUM_BLOCKS * 4:
            assert time.monotonic() < deadline, "the router never followed the epoch again"
            time.sleep(0.5)
        assert second.router.prompts.salt(None) == first.router.prompts.salt(None) == "purge:1/"
