"""Property tests of the gRPC door with the generated client: Generate, Tokenize and Score get
requests with extreme numbers, awkward unicode, huge strings and lists, unset oneofs and wrong
combinations. Every answer is a well-formed success or a refusal whose details name the field
(never INTERNAL, UNKNOWN, UNAVAILABLE or a dropped connection); streams running beside the
fuzzing keep their tokens, and afterwards the same greedy request gets the same tokens from the
same workers. (`test_fuzz_generate.py` fuzzes Generate's ranges; this covers the extremes and
the other RPCs.)"""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
from grpc_fuzz_support import (
    FLOATS,
    ID_TEXT,
    INT32,
    INT64,
    NASTY,
    TEXT,
    TOKEN,
    VOCAB,
    WILD_TEXT,
    Beside,
    Reference,
    check_refusal,
    check_still_serving,
    normal_beside,
)
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
ROLES = ["system", "user", "assistant"]


def _text(text: str) -> pb.Prompt:
    return pb.Prompt(text=text)


def _ids(ids: list[int]) -> pb.Prompt:
    return pb.Prompt(token_ids=pb.TokenIds(ids=ids))


def _chat(turns: list[tuple[str, str]], no_generation_prompt: bool = False) -> pb.Prompt:
    messages = [pb.ChatMessage(role=r, content=c) for r, c in turns]
    return pb.Prompt(
        chat=pb.ChatMessages(messages=messages, no_generation_prompt=no_generation_prompt)
    )


PLAIN_PROMPTS = st.one_of(
    st.builds(_text, st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)),
    st.builds(_ids, st.lists(TOKEN, min_size=1, max_size=24)),
    st.builds(_chat, st.lists(st.tuples(st.sampled_from(ROLES), TEXT), min_size=1, max_size=3)),
)
_WILD_ROLE = st.sampled_from(["", "x", "tool", "developer", "<|im_start|>", *NASTY]) | TEXT
WILD_PROMPTS = st.one_of(
    st.just(pb.Prompt()),  # the oneof unset
    st.builds(_text, WILD_TEXT | st.just("")),
    st.builds(_ids, st.lists(INT64, max_size=5)),
    st.builds(lambda t, k: _ids([t] * k), TOKEN, st.integers(500, 400_000)),
    st.builds(_chat, st.lists(st.tuples(_WILD_ROLE, WILD_TEXT), max_size=4), st.booleans()),
    st.builds(lambda turn, k: _chat([turn] * k), st.tuples(_WILD_ROLE, TEXT), st.integers(1, 5000)),
)
PROMPTS = PLAIN_PROMPTS | WILD_PROMPTS


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


# Per field of a GenerateRequest: (plain values, hostile ones).
GENERATE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "prompt": (PLAIN_PROMPTS, WILD_PROMPTS),
    "max_tokens": (_maybe(st.integers(1, 6)), INT32),
    "temperature": (_maybe(st.floats(0, 2, width=32)), FLOATS),
    "top_k": (st.integers(0, 50), INT32),
    "top_p": (_maybe(st.floats(0.0625, 1, width=32)), FLOATS),
    "seed": (_maybe(st.integers(0, 2**31)), INT64),
    "n": (_maybe(st.integers(1, 3)), INT32),
    "beam_width": (_maybe(st.integers(1, 3)), INT32),
    "stop": (
        st.lists(st.text(min_size=1, max_size=6), max_size=2),
        st.lists(WILD_TEXT | st.just(""), max_size=20),
    ),
    "stop_token_ids": (
        st.lists(TOKEN, max_size=3),
        st.lists(INT64, max_size=4)
        | st.builds(lambda k: list(range(VOCAB)) * k, st.integers(1, 500)),
    ),
    "request_id": (ID_TEXT, WILD_TEXT),
    "cache_salt": (
        _maybe(st.text(max_size=40)),
        st.sampled_from(["tenant:a", "purge:1"]) | WILD_TEXT,
    ),
}
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "n", "beam_width")


@st.composite
def generate_requests(draw: st.DrawFn) -> tuple[pb.GenerateRequest, bool]:
    """Plain values but for up to four fields drawn hostile; now and then no sampling at all.
    Returns the request and whether it is valid (no field drawn hostile)."""
    wild = draw(st.sets(st.sampled_from(sorted(GENERATE_FIELDS)), max_size=4))
    v = {name: draw(GENERATE_FIELDS[name][name in wild]) for name in GENERATE_FIELDS}
    if not {"n", "beam_width"} & wild and (v["n"] or 1) > 1 and (v["beam_width"] or 1) > 1:
        v["beam_width"] = None  # beam search takes n = 1: both above 1 is no valid request
    request = pb.GenerateRequest(
        request_id=v["request_id"], prompt=v["prompt"], no_response_cache=draw(st.booleans())
    )
    if v["cache_salt"] is not None:
        request.cache_salt = v["cache_salt"]
    if draw(st.integers(0, 9)) == 0:
        # Sampling unset: its fields, hostile or not, are not sent.
        return request, not wild & {"prompt", "request_id", "cache_salt"}
    s = request.sampling
    s.top_k, s.ignore_eos = v["top_k"], draw(st.booleans())
    s.stop.extend(v["stop"])
    s.stop_token_ids.extend(v["stop_token_ids"])
    for name in _OPTIONAL:
        if v[name] is not None:
            setattr(s, name, v[name])
    return request, not wild


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(max_queued_per_worker=64)


@pytest.fixture(scope="module")
def reference(server: Any) -> Reference:
    return Reference.of(server)


@pytest.fixture(scope="module")
def beside(server: Any, reference: Reference) -> Any:
    """The normal requests, run again and again while the module's fuzzing goes on."""
    with normal_beside(server) as streams:
        yield streams


def _max_tokens(request: pb.GenerateRequest) -> int:
    s = request.sampling
    return s.max_tokens if s.HasField("max_tokens") else 16


def _check_stream(request: pb.GenerateRequest, messages: list[pb.GenerateResponse]) -> None:
    s = request.sampling
    n = s.n if s.HasField("n") else 1
    finals = [m for m in messages if m.finish_reason]
    assert sorted(m.index for m in finals) == list(range(n)), "one final message per sample"
    assert all(0 <= t < VOCAB for m in messages for t in m.token_ids)
    for final in finals:
        assert final.finish_reason in ("stop", "length"), final.finish_reason
        assert final.HasField("usage") and final.usage.completion_tokens <= _max_tokens(request)


def _sampled(**sampling: Any) -> tuple[pb.GenerateRequest, bool]:
    request = pb.GenerateRequest(prompt=_text("hello"), sampling=pb.SamplingParams(**sampling))
    return request, False  # an edge: a client error or served, either is right


@FUZZ
@given(drawn=generate_requests(), read=st.sampled_from(["all", "first", "none"]))
@example(drawn=_sampled(max_tokens=4, top_k=2**31 - 1), read="all")
@example(drawn=_sampled(max_tokens=4, temperature=1.4e-45), read="all")
@example(drawn=_sampled(max_tokens=4, top_p=1.4e-45), read="all")
@example(drawn=_sampled(max_tokens=4, temperature=3.4028235e38, top_p=1.4e-45), read="all")
@example(drawn=_sampled(max_tokens=4, seed=2**63 - 1, n=16), read="all")
@example(drawn=_sampled(max_tokens=4, seed=-(2**63), n=3, top_k=1), read="all")
@example(drawn=_sampled(max_tokens=4, beam_width=16, temperature=0.0), read="all")
@example(drawn=_sampled(max_tokens=4, stop_token_ids=list(range(VOCAB))), read="all")
@example(drawn=_sampled(max_tokens=6, stop=[NASTY[0] * 200_000, "\U0010ffff" * 16]), read="all")
@example(drawn=_sampled(max_tokens=2**31 - 1, ignore_eos=True, n=16), read="first")
def test_generate_answers_a_stream_or_a_named_refusal(
    server: Any, beside: Beside, drawn: tuple[pb.GenerateRequest, bool], read: str
) -> None:
    """`read`: the whole stream; its first message and then hang up; hang up at once. A valid
    request is served."""
    request, valid = drawn
    if _max_tokens(request) > 32 and read == "all":
        read = "first"  # bounded run time: a long answer is read until it starts
    stub = pb_grpc.InferenceStub(server.channel())
    call = stub.Generate(request, timeout=120)
    try:
        if read == "none":
            call.cancel()
        elif read == "first":
            assert next(call, None) is not None, "an answer without a message"
            call.cancel()
        else:
            _check_stream(request, list(call))
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.CANCELLED and read != "all":
            event("cancelled by the client")
            return
        event(err.code().name)
        check_refusal(err, pb.GenerateRequest.DESCRIPTOR, request.ByteSize())
        assert not valid, ("a valid request was refused", err.details())
        return
    event(f"answered ({read})")


@FUZZ
@given(prompt=PROMPTS, continuation=st.booleans())
def test_tokenize_answers_ids_or_a_named_refusal(
    server: Any, beside: Beside, prompt: pb.Prompt, continuation: bool
) -> None:
    request = pb.TokenizeRequest(prompt=prompt, continuation=continuation)
    stub = pb_grpc.InferenceStub(server.channel())
    try:
        answer = stub.Tokenize(request, timeout=120)
    except grpc.RpcError as err:
        event(err.code().name)
        check_refusal(err, pb.TokenizeRequest.DESCRIPTOR, request.ByteSize())
        return
    event("answered")
    assert answer.token_ids and all(0 <= t < VOCAB for t in answer.token_ids)
    assert answer.num_blocks == len(answer.token_ids) // 4
    if prompt.WhichOneof("kind") == "text":
        assert answer.text == prompt.text


PLAIN_ITEMS = st.one_of(
    st.builds(_text, st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)),
    st.builds(_ids, st.lists(TOKEN, min_size=1, max_size=8)),
)
# Per field of a ScoreRequest: (plain values, hostile ones).
SCORE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "prefix": (PLAIN_PROMPTS, WILD_PROMPTS),
    "items": (
        st.lists(PLAIN_ITEMS, min_size=1, max_size=4),
        st.lists(PROMPTS, max_size=4)
        | st.builds(lambda t, k: [_ids([t])] * k, TOKEN, st.integers(300, 3000)),
    ),
    "label_token_ids": (
        st.lists(TOKEN, min_size=1, max_size=4),
        st.lists(INT64, max_size=4)
        | st.builds(lambda t, k: [t] * k, TOKEN, st.integers(1000, 300_000)),
    ),
    "request_id": (ID_TEXT, WILD_TEXT),
    "cache_salt": (
        _maybe(st.text(max_size=40)),
        st.sampled_from(["tenant:a", "purge:1"]) | WILD_TEXT,
    ),
}


@st.composite
def score_requests(draw: st.DrawFn) -> tuple[pb.ScoreRequest, bool]:
    """Plain values but for up to three fields drawn hostile; and whether none was."""
    wild = draw(st.sets(st.sampled_from(sorted(SCORE_FIELDS)), max_size=3))
    v = {name: draw(SCORE_FIELDS[name][name in wild]) for name in SCORE_FIELDS}
    salt = v.pop("cache_salt")
    request = pb.ScoreRequest(**v)
    if salt is not None:
        request.cache_salt = salt
    return request, not wild


@FUZZ
@given(drawn=score_requests())
@example(  # an answer of 1.2 million log-probs: more than a gRPC message holds
    drawn=(
        pb.ScoreRequest(
            prefix=_text("hello"), items=[_ids([5, 6])] * 4, label_token_ids=[3] * 300_000
        ),
        False,
    )
)
def test_score_answers_logprobs_or_a_named_refusal(
    server: Any, beside: Beside, drawn: tuple[pb.ScoreRequest, bool]
) -> None:
    request, valid = drawn
    stub = pb_grpc.InferenceStub(server.channel())
    try:
        answer = stub.Score(request, timeout=120)
    except grpc.RpcError as err:
        event(err.code().name)
        check_refusal(err, pb.ScoreRequest.DESCRIPTOR, request.ByteSize())
        # Too few free KV blocks right now is the server's load, not the request's fault.
        assert not valid or err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        return
    event("answered")
    num_labels = len(request.label_token_ids)
    assert [len(row.logprobs) for row in answer.scores] == [num_labels] * len(request.items)
    assert all(math.isfinite(x) and x <= 0 for row in answer.scores for x in row.logprobs)


CONTEXT = 512  # the tiny model's


@settings(FUZZ, max_examples=15)
@given(prompt_len=st.integers(CONTEXT - 24, CONTEXT), max_tokens=st.none() | st.integers(1, 40))
def test_an_answer_past_the_context_is_refused_when_asked_for_and_cut_by_default(
    server: Any, beside: Beside, prompt_len: int, max_tokens: int | None
) -> None:
    """As vLLM: a max_tokens the client set that does not fit the context with the prompt is
    INVALID_ARGUMENT naming it; the default (16) is lowered to what fits."""
    sampling = pb.SamplingParams(temperature=0.0, ignore_eos=True)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    request = pb.GenerateRequest(prompt=_ids([7] * prompt_len), sampling=sampling)
    stub = pb_grpc.InferenceStub(server.channel())
    try:
        messages = list(stub.Generate(request, timeout=120))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        field = "prompt" if prompt_len >= CONTEXT else "max_tokens"
        assert field in (err.details() or ""), err.details()
        past = max_tokens is not None and prompt_len + max_tokens > CONTEXT
        assert prompt_len >= CONTEXT or past, "a request that fits was refused"
        return
    room = CONTEXT - prompt_len
    assert max_tokens is None or max_tokens <= room
    assert messages[-1].usage.completion_tokens == min(max_tokens or 16, room)
    assert messages[-1].finish_reason == "length"


def test_streams_beside_the_fuzzing_kept_their_tokens(beside: Beside, reference: Reference) -> None:
    beside.check(reference)


def test_still_serving_the_same_tokens_on_the_same_workers(
    server: Any, reference: Reference
) -> None:
    check_still_serving(server, reference)
