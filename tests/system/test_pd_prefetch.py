"""A handed-off prompt's KV pulled while its prefill runs (`router/request/prefetch.py`,
`workers/peer/prefetch.py`): the prefill worker computes a long prompt in chunks, each
chunk's blocks are pinned at the boundary of the step that computed them and sent to the decode
worker before the rest is computed; the decode worker lands them in its pool, and the request,
arriving with its first token, finds its prompt there and pulls nothing more. Tokens equal
colocated serving's; usage counts the prefetched KV as moved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pd_support import slow_steps, spawn_pulling

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system

BLOCK = 4
PROMPT_TOKENS = 202  # 50 full blocks: two chunks of a pull (32 blocks each)
CHUNK_TOKENS = 64  # the prefill worker's step: 16 blocks, so the first pull chunk is ready early
GREEDY = pb.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PREFILL, DECODE = WorkerId("prefill-0"), WorkerId("decode-0")


@pytest.fixture(scope="module")
def roles(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    import ray

    actors = spawn_pulling(
        engine_config,
        {PREFILL: "prefill", DECODE: "decode"},
        {PREFILL: {"max_num_batched_tokens": CHUNK_TOKENS}},
    )
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _generate(server: Any, ids: list[int]) -> tuple[list[int], pb.Usage]:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=GREEDY,
        no_response_cache=True,
    )
    messages = list(stub.Generate(request, timeout=120))
    return [t for m in messages for t in m.token_ids], messages[-1].usage


def _tiering(actor: Any) -> dict[str, float]:
    import ray

    return dict(ray.get(actor.stats.remote(), timeout=60).tiering)


def test_kv_moves_while_the_prefill_runs(start_router: Any, roles: dict[WorkerId, Any]) -> None:
    ids = [(11 * j + 5) % 300 + 3 for j in range(PROMPT_TOKENS)]
    colocated = start_router(roles, pd_mode="never")
    expected, _ = _generate(colocated, ids)
    pb_grpc.AdminStub(colocated.channel()).Flush(pb.FlushRequest(), timeout=60)

    before_prefill, before_decode = _tiering(roles[PREFILL]), _tiering(roles[DECODE])
    slow_steps(roles[PREFILL], 0.5)  # four steps of a prompt, each long enough to pull beside
    try:
        server = start_router(roles, pd_mode="always")
        tokens, usage = _generate(server, ids)
    finally:
        slow_steps(roles[PREFILL], 0)
    assert tokens == expected
    full = PROMPT_TOKENS // BLOCK * BLOCK
    assert usage.prefill_worker_id == PREFILL and usage.worker_id == DECODE
    assert usage.kv_transfer_tokens == full

    sent, got = _tiering(roles[PREFILL]), _tiering(roles[DECODE])
    # A chunk left the prefill worker before the prompt was all computed...
    assert sent["peer_held_early_chunks"] > before_prefill.get("peer_held_early_chunks", 0)
    # ... and the decode worker landed every block before the request came: it pulled none.
    landed = got["peer_prefetched_blocks"] - before_decode.get("peer_prefetched_blocks", 0)
    assert landed == full // BLOCK
    assert got["peer_pulled_blocks"] == before_decode.get("peer_pulled_blocks", 0)


def test_off_the_hand_off_pulls_it_all(start_router: Any, roles: dict[WorkerId, Any]) -> None:
    ids = [(13 * j + 2) % 300 + 3 for j in range(PROMPT_TOKENS)]
    colocated = start_router(roles, pd_mode="never")
    expected, _ = _generate(colocated, ids)
    pb_grpc.AdminStub(colocated.channel()).Flush(pb.FlushRequest(), timeout=60)

    before = _tiering(roles[DECODE])
    server = start_router(roles, pd_mode="always", pd_prefetch=False)
    tokens, usage = _generate(server, ids)
    assert tokens == expected and usage.kv_transfer_tokens == PROMPT_TOKENS // BLOCK * BLOCK
    after = _tiering(roles[DECODE])
    assert after["peer_prefetches"] == before.get("peer_prefetches", 0)
    assert after["peer_pulled_blocks"] - before.get("peer_pulled_blocks", 0) == 50
