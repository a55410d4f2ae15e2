"""End to end over real Ray workers and a real gRPC router, with the generated client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from suite_support import wait_for
from worker_support import StepGate

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.system

# Each prefix is a few times longer than a sentence: the policy evens out the workers' busy
# seconds lately, and for a prefix of a few blocks moving away costs less than that, so a group of
# a one-sentence prefix may rightly be split by a worker's earlier work.
PREFIXES = [
    "A shared system prompt is cached once and reused by every request of its group. " * 5,
    "Routing sends each request to the worker that already holds its prefix, said the fox. " * 5,
    "hello world, hello router, hello worker; the cache hit ratio goes up and up again. " * 5,
]


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(policy="prefix_aware")


@pytest.fixture(scope="module")
def stub(server: Any) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(server.channel())


@pytest.fixture(scope="module")
def admin(server: Any) -> pb_grpc.AdminStub:
    return pb_grpc.AdminStub(server.channel())


def _generate(
    stub: pb_grpc.InferenceStub, prompt: pb.Prompt, **kw: Any
) -> tuple[list[int], list[pb.GenerateResponse]]:
    salt = kw.pop("cache_salt", None)
    kw.setdefault("temperature", 0.0)
    sampling = pb.SamplingParams(ignore_eos=True, **kw)
    request = pb.GenerateRequest(prompt=prompt, sampling=sampling)
    if salt is not None:
        request.cache_salt = salt
    messages = list(stub.Generate(request, timeout=60))
    return [t for m in messages for t in m.token_ids], messages


def _ids(text: str, stub: pb_grpc.InferenceStub) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(prompt=pb.Prompt(text=text))).token_ids)


def test_stream_equals_offline_greedy(stub: Any, engine_config: EngineConfig) -> None:
    offline = Engine(engine_config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt_ids = [5, 17, 33, 99, 250, 3, 8, 64, 120]
    text = "The quick brown fox jumps over the lazy dog."
    expected = [list(o.token_ids) for o in offline.generate([prompt_ids, text], greedy)]

    tokens, messages = _generate(
        stub, pb.Prompt(token_ids=pb.TokenIds(ids=prompt_ids)), max_tokens=12
    )
    assert tokens == expected[0]
    assert len(messages) > 1, "tokens must stream, not arrive in one message"
    last = messages[-1]
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == 12
    assert last.usage.worker_id in {"worker-0", "worker-1"}
    assert all(not m.finish_reason for m in messages[:-1])

    tokens, messages = _generate(stub, pb.Prompt(text=text), max_tokens=12)
    assert tokens == expected[1]
    assert "".join(m.text for m in messages) == offline.tokenizer.decode(expected[1])


def test_n_samples_and_beams_stream_by_index(stub: Any) -> None:
    prompt = pb.Prompt(token_ids=pb.TokenIds(ids=[9, 8, 7, 6, 5]))
    _, messages = _generate(stub, prompt, max_tokens=4, n=3, seed=1, temperature=1.0)
    finals = [m for m in messages if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1, 2]
    for index in range(3):
        assert sum(len(m.token_ids) for m in messages if m.index == index) == 4
    tokens, messages = _generate(stub, prompt, max_tokens=4, beam_width=2)
    assert len(tokens) == 4 and messages[-1].finish_reason == "length"


def test_chat_and_tokenize_agree(stub: Any) -> None:
    chat = pb.Prompt(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    ids = list(stub.Tokenize(pb.TokenizeRequest(prompt=chat)).token_ids)
    assert ids[0] == 1  # <|im_start|>: the ChatML template was applied
    _, messages = _generate(stub, chat, max_tokens=3)
    assert messages[-1].usage.prompt_tokens == len(ids)


def _run_groups(stub: Any, admin: Any) -> tuple[float, list[list[str]]]:
    """Three prefix groups of four requests, group after group; returns the hit ratio and
    the workers that served each group."""
    admin.Flush(pb.FlushRequest())
    cached = total = 0
    workers: list[list[str]] = []
    for g, prefix in enumerate(PREFIXES):
        workers.append([])
        for i in range(4):
            ids = _ids(f"{prefix}Question {g}.{i}?", stub)
            _, messages = _generate(stub, pb.Prompt(token_ids=pb.TokenIds(ids=ids)), max_tokens=2)
            usage = messages[-1].usage
            cached += sum(usage.cached_tokens.values())
            total += usage.prompt_tokens
            workers[-1].append(usage.worker_id)
    return cached / total, workers


def test_prefix_aware_beats_round_robin(stub: Any, admin: Any, make_server: Any) -> None:
    ratio, workers = _run_groups(stub, admin)
    for group in workers:
        assert len(set(group)) == 1, f"a prefix group was split: {workers}"
    assert len({group[0] for group in workers}) == 2, "groups should spread over both workers"

    rr = make_server(policy="round_robin")
    rr_stub = pb_grpc.InferenceStub(rr.channel())
    rr_ratio, rr_workers = _run_groups(rr_stub, pb_grpc.AdminStub(rr.channel()))
    assert all(len(set(group)) == 2 for group in rr_workers)
    assert ratio > rr_ratio + 0.1, (ratio, rr_ratio)

    stats = admin.Stats(pb.StatsRequest())
    assert stats.policy == "prefix_aware" and stats.cached_tokens > 0
    assert stats.block_size == 4 and stats.num_resyncs >= 2


BAD_REQUESTS = [
    (pb.GenerateRequest(prompt=pb.Prompt(text="")), "prompt.text"),
    (pb.GenerateRequest(), "prompt must be set"),
    (
        pb.GenerateRequest(prompt=pb.Prompt(text="hi"), sampling=pb.SamplingParams(max_tokens=0)),
        "sampling.max_tokens must be >= 1",
    ),
    (
        pb.GenerateRequest(prompt=pb.Prompt(text="hi"), sampling=pb.SamplingParams(top_p=2.0)),
        "sampling.top_p",
    ),
    (
        pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[1, 2, 999]))),
        "prompt.token_ids[2] = 999 is outside the vocabulary",
    ),
    (
        pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[3] * 600))),
        "context is 512",
    ),
    (
        pb.GenerateRequest(prompt=pb.Prompt(text="hi"), sampling=pb.SamplingParams(n=100000)),
        "sampling.n",
    ),
    (
        pb.GenerateRequest(
            prompt=pb.Prompt(text="hi"), sampling=pb.SamplingParams(stop_token_ids=[4000])
        ),
        "sampling.stop_token_ids[0]",
    ),
]


@pytest.mark.parametrize(("request_", "message"), BAD_REQUESTS)
def test_bad_input_is_invalid_argument(stub: Any, request_: Any, message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_garbage_bytes_then_still_serving(server: Any, stub: Any) -> None:
    raw = server.channel().unary_stream(
        "/cachesvc.v1.Inference/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\xff\xff\xff\xff\x0f garbage", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cachesvc.v1.GenerateRequest" in err.value.details()
    tokens, _ = _generate(stub, pb.Prompt(text="still here"), max_tokens=2)
    assert len(tokens) == 2


def test_cache_salt_isolates_tenants(stub: Any) -> None:
    ids = _ids(PREFIXES[0] + "Tenant question, same for both tenants.", stub)
    prompt = pb.Prompt(token_ids=pb.TokenIds(ids=ids))

    def cached(salt: str) -> int:
        _, messages = _generate(stub, prompt, max_tokens=1, cache_salt=salt)
        return sum(messages[-1].usage.cached_tokens.values())

    cached("tenant-a")
    assert cached("tenant-a") >= len(ids) - 4, "tenant A's repeat should hit its cache"
    assert cached("tenant-b") == 0, "tenant B must not see tenant A's blocks"


def _idle(admin: Any) -> bool:
    workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
    return all(w.num_running == 0 and w.num_waiting == 0 for w in workers)


def test_deadline_aborts_on_the_worker(stub: Any, admin: Any, worker_pair: dict[Any, Any]) -> None:
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[7] * 8)),
        sampling=pb.SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True),
    )
    # The worker's steps wait at a gate: the deadline passes while the request is on its first
    # step, however fast or slow the machine, and what ran after it is counted in steps.
    gates = [StepGate(actor) for actor in worker_pair.values()]
    try:
        call = stub.Generate(request, timeout=5)
        wait_for(lambda: any(g.num_held() for g in gates), 60, "the request's first step")
        [gate] = [g for g in gates if g.num_held()]
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(gate.has_waiting_call, 60, "the router to abort the request on the worker")
        gate.open()
        wait_for(lambda: _idle(admin), 60, "the worker to drop the request")
        # The step under way when the abort came, and none of the other 479 tokens.
        assert gate.num_passed() == 1
    finally:
        for g in gates:
            g.remove()


def test_admin_health_and_reflection(server: Any, admin: Any) -> None:
    workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
    assert [w.worker_id for w in workers] == ["worker-0", "worker-1"]
    assert all(w.health == pb.WorkerInfo.HEALTHY and w.blocks["hbm"].total == 256 for w in workers)
    assert admin.Flush(pb.FlushRequest()).num_blocks_dropped >= 0

    health = health_pb2_grpc.HealthStub(server.channel())
    status = health.Check(health_pb2.HealthCheckRequest(service="cachesvc.v1.Inference"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    [answer] = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {"cachesvc.v1.Inference", "cachesvc.v1.Admin", "cachesvc.v1.Cache"} <= names
    assert "grpc.health.v1.Health" in names


def test_score(stub: Any, engine_config: EngineConfig) -> None:
    request = pb.ScoreRequest(
        prefix=pb.Prompt(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9])),
        items=[pb.Prompt(token_ids=pb.TokenIds(ids=[10, 11])), pb.Prompt(text="fox")],
        label_token_ids=[3, 4],
    )
    if not hasattr(Engine, "score"):
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "scoring" in err.value.details()
        return
    response = stub.Score(request)
    assert len(response.scores) == 2
    assert all(len(s.logprobs) == 2 and all(x <= 0 for x in s.logprobs) for s in response.scores)


def test_tokenize_as_a_continuation_matches_score_items(
    make_server: Any, tiny_model_dir: Path
) -> None:
    from workers.text.tokenizer import Tokenizer

    stub = pb_grpc.InferenceStub(make_server(policy="round_robin").channel())
    tokenizer = Tokenizer.from_path(tiny_model_dir)
    for text in ("hello", " the cache", "router!"):
        request = pb.TokenizeRequest(prompt=pb.Prompt(text=text), continuation=True)
        reply = stub.Tokenize(request)
        assert list(reply.token_ids) == tokenizer.encode(text, add_special_tokens=False)
        assert reply.text == text
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(prompt=pb.Prompt(text=""), continuation=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_auth_token(make_server: Any, tiny_model_dir: Path) -> None:
    secured = make_server(policy="least_loaded", auth_token="s3cret")
    stub = pb_grpc.InferenceStub(secured.channel())
    request = pb.TokenizeRequest(prompt=pb.Prompt(text="hello"))
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(request, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt=pb.Prompt(text="hi"))))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    good = [("authorization", "Bearer s3cret")]
    assert stub.Tokenize(request, metadata=good).token_ids
    health = health_pb2_grpc.HealthStub(secured.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == (
        health_pb2.HealthCheckResponse.SERVING
    )


def test_flush_and_purge_drop_what_a_prompt_cached(stub: Any, admin: Any) -> None:
    ids = [7 + 3 * i for i in range(40)]  # ten blocks
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )

    def cached() -> int:
        return sum(list(stub.Generate(request, timeout=60))[-1].usage.cached_tokens.values())

    cached()
    assert cached() >= 36
    assert admin.Flush(pb.FlushRequest()).num_blocks_dropped >= 10
    assert cached() == 0, "a flushed prefix is computed again"
    purged = admin.Purge(pb.PurgeRequest()).num_blocks_purged
    assert purged["hbm"] >= 10
    assert cached() == 0, "a purged prefix is computed again"
