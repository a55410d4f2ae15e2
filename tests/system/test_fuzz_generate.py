"""Hypothesis fuzzing of Generate over the wire: random field values, in range and out of it.
Every call ends as a valid stream, INVALID_ARGUMENT or RESOURCE_EXHAUSTED — never INTERNAL or
UNKNOWN — and the server keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
VOCAB = 320
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
NAN, INF = float("nan"), float("inf")
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
ROLES = st.sampled_from(["system", "user", "assistant"])
CHAT = st.lists(st.tuples(ROLES, TEXT), min_size=1, max_size=3)
# Per field: (values the server must accept, values out of range or malformed).
FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "prompt": (
        st.one_of(
            st.builds(lambda t: ("text", t), st.text(st.characters(codec="utf-8"), min_size=1)),
            st.builds(lambda ids: ("ids", ids), IDS),
            st.builds(lambda c: ("chat", c), CHAT),
        ),
        st.one_of(
            st.just(("text", "")),
            st.just(("ids", [])),
            st.builds(lambda ids: ("ids", ids), st.lists(INT64, min_size=1, max_size=5)),
            st.just(("ids", [3] * 600)),
            st.just(("chat", [])),
            st.builds(lambda c: ("chat", [("", c)]), TEXT),
            st.just(("unset", None)),
        ),
    ),
    "max_tokens": (_maybe(st.integers(1, 6)), st.one_of(st.integers(-5, 0), st.just(2**31 - 1))),
    "temperature": (
        _maybe(st.floats(0, 2, width=32)),
        st.sampled_from([-1.0, -1e-6, NAN, INF, -INF]) | st.floats(max_value=-1, width=32),
    ),
    "top_k": (st.integers(0, 50), st.integers(-(2**31), -1)),
    "top_p": (
        _maybe(st.floats(0.0625, 1, width=32)),
        st.sampled_from([0.0, -0.5, NAN, INF]) | st.floats(min_value=1.5, width=32),
    ),
    "seed": (_maybe(INT64), st.none()),
    "n": (_maybe(st.integers(1, 3)), st.one_of(st.integers(-3, 0), st.integers(17, 2**31 - 1))),
    "beam_width": (_maybe(st.integers(1, 3)), st.integers(-3, 0) | st.integers(17, 100)),
    "stop": (
        st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=8), max_size=3),
        st.one_of(st.lists(TEXT, min_size=17, max_size=20), st.just(["ok", ""])),
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB - 1), max_size=3),
        st.lists(INT64.filter(lambda t: not 0 <= t < VOCAB), min_size=1, max_size=2),
    ),
    # An id is echoed and logged: no control characters (router.request.ids).
    "request_id": (
        st.text(st.characters(codec="utf-8", exclude_categories=["Cc"]), max_size=64),
        st.text(min_size=257, max_size=300) | st.just("line\r\nbreak"),
    ),
    "cache_salt": (_maybe(st.text(max_size=64)), st.text(min_size=257, max_size=300)),
}


def _prompt(kind: str, value: Any) -> pb.Prompt:
    if kind == "text":
        return pb.Prompt(text=value)
    if kind == "ids":
        return pb.Prompt(token_ids=pb.TokenIds(ids=value))
    if kind == "chat":
        messages = [pb.ChatMessage(role=r, content=c) for r, c in value]
        return pb.Prompt(chat=pb.ChatMessages(messages=messages))
    return pb.Prompt()


@st.composite
def generate_requests(draw: st.DrawFn) -> tuple[pb.GenerateRequest, bool]:
    """About half valid requests; the rest with one to three fields out of range. Returns the
    request and whether it is valid (every field drawn from its accepted values)."""
    corrupt = draw(
        st.one_of(st.just(set()), st.sets(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3))
    )
    v = {name: draw(FIELDS[name][name in corrupt]) for name in FIELDS}
    if not {"n", "beam_width"} & corrupt and (v["n"] or 1) > 1 and (v["beam_width"] or 1) > 1:
        v["beam_width"] = None  # beam search takes n = 1: both above 1 is no valid request
    sampling = pb.SamplingParams(
        stop=v["stop"],
        stop_token_ids=v["stop_token_ids"],
        top_k=v["top_k"],
        ignore_eos=draw(st.booleans()),
    )
    for name in ("max_tokens", "temperature", "top_p", "seed", "n", "beam_width"):
        if v[name] is not None:
            setattr(sampling, name, v[name])
    request = pb.GenerateRequest(
        request_id=v["request_id"], prompt=_prompt(*v["prompt"]), sampling=sampling
    )
    if v["cache_salt"] is not None:
        request.cache_salt = v["cache_salt"]
    return request, not corrupt


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(max_queued_per_worker=64)


def _check_stream(request: pb.GenerateRequest, messages: list[pb.GenerateResponse]) -> None:
    n = request.sampling.n if request.sampling.HasField("n") else 1
    finals = [m for m in messages if m.finish_reason]
    assert sorted(m.index for m in finals) == list(range(n)), "one final message per sample"
    for final in finals:
        assert final.finish_reason in ("stop", "length")
        assert final.HasField("usage") and final.usage.completion_tokens >= 1


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=generate_requests())
def test_fuzzed_generate_is_a_stream_or_a_client_error(
    server: Any, drawn: tuple[pb.GenerateRequest, bool]
) -> None:
    request, valid = drawn
    stub = pb_grpc.InferenceStub(server.channel())
    try:
        messages = list(stub.Generate(request, timeout=120))
    except grpc.RpcError as err:
        event(err.code().name)
        assert not valid, ("a valid request was refused", err.code(), err.details(), request)
        assert err.code() in ALLOWED, (err.code(), err.details(), request)
        return
    event("stream" if valid else "stream of a corrupt request")
    _check_stream(request, messages)


def test_still_serving_after_the_fuzzing(server: Any) -> None:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(text="still here"),
        sampling=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    assert list(stub.Generate(request, timeout=60))[-1].usage.completion_tokens == 3
    health = health_pb2_grpc.HealthStub(server.channel())
    reply = health.Check(health_pb2.HealthCheckRequest(service="cachesvc.v1.Inference"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    internal = server.router.metrics.requests.labels("grpc", "Generate", "INTERNAL")._value.get()
    assert internal == 0
