"""The response cache through gRPC: a hit is exactly a fresh generation, tenants never share
one, only deterministic requests are cached, and Flush empties it."""

from __future__ import annotations

from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.tenants import TenantToken

pytestmark = pytest.mark.system
TENANTS = (TenantToken("acme", "acme-tok"), TenantToken("umbrella", "umbrella-tok"))
ACME = [("authorization", "Bearer acme-tok")]
UMBRELLA = [("authorization", "Bearer umbrella-tok")]
OPERATOR = [("authorization", "Bearer operator-tok")]
SAMPLING = {
    "greedy": pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    "seeded": pb.SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=2, ignore_eos=True),
    "beam": pb.SamplingParams(max_tokens=6, temperature=0.0, beam_width=2, ignore_eos=True),
}


@pytest.fixture(scope="module")
def stub(make_server: Any) -> pb_grpc.InferenceStub:
    server = make_server(auth_token="operator-tok", tenant_tokens=TENANTS, response_cache_mb=64)
    return pb_grpc.InferenceStub(server.channel())


def _answer(stub: Any, sampling: pb.SamplingParams, who: Any = ACME, **extra: Any) -> Any:
    request = pb.GenerateRequest(
        prompt=pb.Prompt(text="A shared system prompt is cached once and reused."),
        sampling=sampling,
        **extra,
    )
    messages = list(stub.Generate(request, metadata=who, timeout=60))
    samples = {}
    for m in messages:
        tokens, text, final = samples.get(m.index, ([], "", None))
        samples[m.index] = (
            tokens + list(m.token_ids),
            text + m.text,
            m if m.finish_reason else final,
        )
    answer = {i: (t, x, f.finish_reason) for i, (t, x, f) in samples.items()}
    flags = {f.usage.from_response_cache for _, _, f in samples.values()}
    assert len(flags) == 1
    return answer, flags.pop(), [f.usage for _, _, f in samples.values()]


@pytest.mark.parametrize("mode", sorted(SAMPLING))
def test_a_hit_is_exactly_a_fresh_generation(stub: Any, mode: str) -> None:
    fresh, cached, _ = _answer(stub, SAMPLING[mode], no_response_cache=True)
    assert not cached
    first, cached, _ = _answer(stub, SAMPLING[mode])
    assert not cached and first == fresh
    again, cached, usages = _answer(stub, SAMPLING[mode])
    assert cached and again == fresh
    assert all(u.worker_id == "" and not u.cached_tokens and u.computed_tokens == 0 for u in usages)
    # Another tenant asking the same thing generates its own answer.
    theirs, cached, _ = _answer(stub, SAMPLING[mode], UMBRELLA)
    assert not cached and theirs == fresh


def test_sampling_without_a_seed_is_never_cached(stub: Any) -> None:
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.9, ignore_eos=True)
    assert not _answer(stub, sampling)[1]
    assert not _answer(stub, sampling)[1]


def test_opting_out_and_flush(make_server: Any) -> None:
    server = make_server(response_cache_mb=64)
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    greedy = SAMPLING["greedy"]
    assert not _answer(stub, greedy, [])[1]
    assert _answer(stub, greedy, [])[1]
    assert not _answer(stub, greedy, [], no_response_cache=True)[1]
    admin.Flush(pb.FlushRequest())
    assert not _answer(stub, greedy, [])[1], "Flush empties the response cache"
    assert _answer(stub, greedy, [])[1]
    assert admin.Purge(pb.PurgeRequest()).num_blocks_purged["response"] == 1
    metrics = server.router.responses.stats
    assert metrics.hits == 2 and metrics.stores >= 2


def test_the_cache_can_be_turned_off(make_server: Any) -> None:
    server = make_server(response_cache_mb=0)
    stub = pb_grpc.InferenceStub(server.channel())
    assert server.router.responses is None
    assert not _answer(stub, SAMPLING["greedy"], [])[1]
    assert not _answer(stub, SAMPLING["greedy"], [])[1]
