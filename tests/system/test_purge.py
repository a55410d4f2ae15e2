"""Admin.Purge through real gRPC over two workers that pull from each other and share a real
Redis tier: blocks cached under the purged epoch after the purge (by a request that was already
under way, which keeps its pre-purge salt) are still held by a peer and by Redis, and still serve
a request of that old salt; yet nothing of them reaches a request that arrives after the purge,
through this router or another sharing its Redis index. Those requests compute the whole prompt
and say the same tokens."""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from routing_support import tokens_and_usage

from cachesvc.kv.config import TierConfig
from cachesvc.kv.hashing import epoch_salt, hash_blocks, root_hash
from cachesvc.kv.tiers.redis_tier import KEY_PREFIX
from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig
from workers.protocol import HolderHint, StreamDelta

pytestmark = pytest.mark.system

PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
NUM_BLOCKS = 10  # full blocks of the prompt (block size 4)
NS = "purge-test"  # the workers' Ray namespace


@pytest.fixture(scope="module")
def workers(
    ray_cluster: None, engine_config: EngineConfig, redis_url: str
) -> Iterator[dict[WorkerId, Any]]:
    import ray

    from workers.spawn import spawn_worker

    # Every block reused once goes to Redis; a planned load is always fetched (the tiny model
    # computes faster than a pull's prior cost), so whatever is reachable is used.
    tiers = TierConfig(redis_url=redis_url, redis_min_reuse=1, plan="fetch", calibrate=False)
    config = dataclasses.replace(
        engine_config, peer_pull=True, peer_pull_timeout_s=5.0, tiers=tiers
    )
    suffix = uuid.uuid4().hex[:6]
    actors = {
        WorkerId(f"w{i}"): spawn_worker(
            f"w{i}",
            config,
            name=f"purge-w{i}-{suffix}",
            namespace=NS,
            num_cpus=0.5,
            max_restarts=0,
        )
        for i in range(2)
    }
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _direct(
    actor: Any, prompt: list[int], salt: str | None, holder: HolderHint | None = None
) -> tuple[list[int], StreamDelta]:
    """A request sent straight to a worker with a salt of our choosing: what the router sends."""
    import ray

    stream = actor.generate.options(num_returns="streaming").remote(
        prompt, PARAMS, uuid.uuid4().hex, salt, holder
    )
    deltas = [ray.get(ref) for ref in stream]
    assert all(isinstance(d, StreamDelta) for d in deltas), deltas
    assert deltas[-1].usage is not None
    return [t for d in deltas for t in d.token_ids], deltas[-1]


def _pulled(actors: dict[WorkerId, Any]) -> int:
    import ray

    return sum(ray.get(a.peer_stats.remote())["pulled_blocks"] for a in actors.values())


def _wait_in_redis(redis_url: str, keys: list[bytes]) -> int:
    """How many of `keys` Redis holds once the workers' background writes had time to land."""
    import redis

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while (held := sum(client.exists(k) for k in keys)) < len(keys):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return held


def test_purged_prefix_is_served_by_no_peer_and_no_shared_tier(
    workers: dict[WorkerId, Any], start_router: Any, redis_url: str
) -> None:
    namespace = f"purge-{uuid.uuid4().hex[:8]}"
    shared = {"policy": "round_robin", "redis_url": redis_url, "redis_namespace": namespace}
    server = start_router(workers, **shared)
    other = start_router(workers, **shared)  # a second router sharing the index
    rng = random.Random(uuid.uuid4().int)
    # One prompt per check below: each is the first of its prompt after the purge (a second
    # one would rightly find the blocks the first computed under the new epoch).
    prompts = [[rng.randrange(3, 300) for _ in range(NUM_BLOCKS * 4 + 2)] for _ in range(3)]
    expected = [tokens_and_usage(server, prompt)[0] for prompt in prompts]
    holder_id, puller_id = sorted(workers)
    holder, puller = workers[holder_id], workers[puller_id]
    info = server.router.pool.state(holder_id).info
    assert info is not None and info.actor_name
    hint = HolderHint(info.actor_name, NUM_BLOCKS)

    admin = pb_grpc.AdminStub(server.channel())
    assert admin.Purge(pb.PurgeRequest()).num_blocks_purged["hbm"] >= 3 * NUM_BLOCKS

    # Requests routed before the purge reach the holder after it: their salt is the old one,
    # so they cache the prompts again under the old hashes and (reused once) share them.
    old_salt = None
    fingerprint = server.router.pool.model.model_fingerprint
    keys = []
    for prompt, tokens in zip(prompts, expected, strict=True):
        for _ in range(2):
            assert _direct(holder, prompt, old_salt)[0] == tokens
        old_hashes = hash_blocks(prompt, 4, root_hash(fingerprint, 4, old_salt or ""))
        keys += [f"{KEY_PREFIX}:{fingerprint}:{h.hex()}".encode() for h in old_hashes]
    assert _wait_in_redis(redis_url, keys) == len(keys), "the old blocks are in Redis again"
    # The peer and Redis do still serve them, to a request of the old salt.
    tokens, old = _direct(puller, prompts[0], old_salt, hint)
    assert tokens == expected[0]
    assert old.usage is not None and sum(old.usage.cached_tokens.values()) == NUM_BLOCKS * 4

    # A request that arrives after the purge: a pull from the holder and Redis serve nothing.
    pulled = _pulled(workers)
    new_salt = epoch_salt(None, server.router.pool.index.purge_epoch())
    tokens, new = _direct(puller, prompts[1], new_salt, hint)
    assert tokens == expected[1]
    assert new.usage is not None and new.usage.computed_tokens == len(prompts[1])
    assert sum(new.usage.cached_tokens.values()) == 0
    assert _pulled(workers) == pulled

    # Nor through this router or the other one sharing its index (whichever worker it picks).
    for router, prompt, want in (
        (server, prompts[0], expected[0]),
        (other, prompts[2], expected[2]),
    ):
        tokens, usage = tokens_and_usage(router, prompt)
        assert tokens == want
        assert sum(usage.cached_tokens.values()) == 0, dict(usage.cached_tokens)
        assert usage.computed_tokens == len(prompt)
    assert _pulled(workers) == pulled
