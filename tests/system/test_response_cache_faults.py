"""The response cache through the real gRPC server: tenants (and salts) that differ only at the
end of a long name never share an answer, and a Redis store that is frozen (SIGSTOP) or dead
turns hits into misses while every request still gets its right tokens."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cachesvc.bench.local_redis import LocalRedis
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.tenants import TenantToken

pytestmark = pytest.mark.system
STEM = "acme-corporation-production-eu-west-1-inference-cluster-team-"
TEAM_A, TEAM_B = STEM + "a" * 3, STEM + "b" * 3  # 64 characters, the longest name allowed
TENANTS = (TenantToken(TEAM_A, "team-a-tok"), TenantToken(TEAM_B, "team-b-tok"))
AS_A = [("authorization", "Bearer team-a-tok")]
AS_B = [("authorization", "Bearer team-b-tok")]
OPERATOR = [("authorization", "Bearer operator-tok")]
GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _answer(stub: Any, who: Any = (), **extra: Any) -> tuple[list[int], bool]:
    """The tokens of one greedy answer, and whether the response cache gave it."""
    request = pb.GenerateRequest(
        prompt=pb.Prompt(text="A shared system prompt is cached once and reused."),
        sampling=GREEDY,
        **extra,
    )
    tokens: list[int] = []
    cached = None
    for message in stub.Generate(request, metadata=list(who), timeout=60):
        tokens += message.token_ids
        if message.finish_reason:
            cached = message.usage.from_response_cache
    assert cached is not None, "the stream ended without a final message"
    return tokens, cached


def _stored(server: Any) -> None:
    """Wait until the router wrote what it queued (answers are stored after the stream)."""
    server.run(server.router.responses.flush())


def test_long_tenant_names_and_salts_that_differ_at_the_end_never_share(make_server: Any) -> None:
    assert len(TEAM_A) == len(TEAM_B) == 64
    server = make_server(auth_token="operator-tok", tenant_tokens=TENANTS, response_cache_mb=64)
    stub = pb_grpc.InferenceStub(server.channel())
    fresh, cached = _answer(stub, AS_A)
    assert not cached
    _stored(server)
    assert _answer(stub, AS_A) == (fresh, True)
    assert _answer(stub, AS_B) == (fresh, False), "team b got team a's stored answer"
    _stored(server)
    assert _answer(stub, AS_B) == (fresh, True)
    # The operator's requests with salts of 256 bytes, equal but for the last one.
    salt_a, salt_b = "s" * 255 + "a", "s" * 255 + "b"
    assert _answer(stub, OPERATOR, cache_salt=salt_a) == (fresh, False)
    _stored(server)
    assert _answer(stub, OPERATOR, cache_salt=salt_a) == (fresh, True)
    assert _answer(stub, OPERATOR, cache_salt=salt_b) == (fresh, False)


def _redis_server(make_server: Any, redis: LocalRedis, tmp_path: Path) -> Any:
    """A router whose response cache is in `redis` (the index stays in memory)."""
    key_file = tmp_path / "response.key"
    key_file.write_text("k" * 32)
    return make_server(
        response_cache_mb=64,
        response_cache_redis_url=redis.url,
        response_cache_key_file=str(key_file),
    )


def test_a_frozen_redis_turns_hits_into_misses_with_the_right_tokens(
    make_server: Any, own_redis: LocalRedis, tmp_path: Path
) -> None:
    assert own_redis.proc is not None
    server = _redis_server(make_server, own_redis, tmp_path)
    stub = pb_grpc.InferenceStub(server.channel())
    stats = server.router.responses.stats
    fresh, _ = _answer(stub)
    _stored(server)
    assert _answer(stub) == (fresh, True)
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(4):
            assert _answer(stub) == (fresh, False)
        # The first lookup failed, closing its connection: later ones do not wait on Redis,
        # they miss at once while the store reconnects in the background.
        assert stats.errors >= 1 and stats.skipped >= 3 and stats.redis_up is False
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    # Thawed, the breaker's next probe finds Redis and the stored answer again.
    deadline = time.monotonic() + 60
    while not _answer(stub)[1]:
        assert time.monotonic() < deadline, "Redis is back but the router never used it again"
        time.sleep(0.2)


def test_a_dead_redis_turns_hits_into_misses_with_the_right_tokens(
    make_server: Any, own_redis: LocalRedis, tmp_path: Path
) -> None:
    server = _redis_server(make_server, own_redis, tmp_path)
    stub = pb_grpc.InferenceStub(server.channel())
    fresh, _ = _answer(stub)
    _stored(server)
    assert _answer(stub) == (fresh, True)
    own_redis.stop(kill=True)
    for _ in range(2):
        assert _answer(stub) == (fresh, False)
    assert server.router.responses.stats.errors >= 1
