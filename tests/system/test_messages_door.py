"""Anthropic's Messages API on the HTTP door, over real Ray workers: the official `anthropic`
SDK unchanged (non-streaming, streaming, stop sequences, usage, errors), `cache_control`
refusals in Anthropic's shape, the usage split on every door (read + written + uncached adds up
to the prompt as the router tokenizes it), and an affinity key keeping its requests on its
worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from http_support import MODEL_NAME, base_url, call, start_http, stop_http

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system

KEY = "operator-token"
AUTH = [("authorization", f"Bearer {KEY}")]
# The SDK has no sampling arguments (the API's defaults apply); the body still takes them.
GREEDY = {"temperature": 0}
SYSTEM = "A shared system prompt is cached once and reused by every request of its group."


@pytest.fixture(scope="module")
def door(make_server: Any) -> Iterator[tuple[Any, Any]]:
    server = make_server(auth_token=KEY)
    http = start_http(server)
    yield server, http
    stop_http(server, http)


@pytest.fixture(scope="module")
def sdk() -> Any:
    """The official `anthropic` SDK (the dev extra installs it)."""
    return pytest.importorskip("anthropic")


def _client(sdk: Any, door: tuple[Any, Any], key: str = KEY) -> Any:
    url = base_url(door[1]).removesuffix("/v1")
    return sdk.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def _system(tag: str, ttl: str = "5m") -> list[dict[str, Any]]:
    control = {"type": "ephemeral", "ttl": ttl}
    return [{"type": "text", "text": f"{tag}: {SYSTEM}", "cache_control": control}]


def _chat(tag: str, question: str) -> list[pb.ChatMessage]:
    return [
        pb.ChatMessage(role="system", content=f"{tag}: {SYSTEM}"),
        pb.ChatMessage(role="user", content=question),
    ]


def _num_prompt_tokens(server: Any, tag: str, question: str) -> int:
    """The prompt's length as the router's own Tokenize sees it (template applied)."""
    stub = pb_grpc.InferenceStub(server.channel())
    prompt = pb.Prompt(chat=pb.ChatMessages(messages=_chat(tag, question)))
    reply = stub.Tokenize(pb.TokenizeRequest(prompt=prompt), metadata=AUTH, timeout=60)
    return len(reply.token_ids)


def _split(usage: Any) -> tuple[int, int, int]:
    read, written = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
    return read, written, usage.input_tokens


def test_sdk_usage_adds_up_and_the_second_request_reads(sdk: Any, door: tuple[Any, Any]) -> None:
    server, _ = door
    client = _client(sdk, door)
    replies = [
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=6,
            extra_body=GREEDY,
            system=_system("sdk"),
            messages=[{"role": "user", "content": question}],
        )
        for question in ("first question", "second question")
    ]
    for reply, question in zip(replies, ("first question", "second question"), strict=True):
        assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL_NAME
        assert reply.id.startswith("msg_") and reply.content[0].type == "text"
        assert reply.usage.output_tokens <= 6
        assert reply.stop_reason in ("max_tokens", "end_turn")
        assert sum(_split(reply.usage)) == _num_prompt_tokens(server, "sdk", question)
    (read0, written0, _), (read1, written1, _) = (_split(r.usage) for r in replies)
    assert read0 == 0 and written0 > 0  # the first wrote the system prompt's blocks
    assert read1 > 0  # the second read them


def test_sdk_stream_is_the_whole_answer_event_by_event(sdk: Any, door: tuple[Any, Any]) -> None:
    client = _client(sdk, door)
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "extra_body": GREEDY,
        "system": _system("stream", ttl="1h"),
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello router"}]}],
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert sum(_split(final.usage)) == sum(_split(whole.usage))
    assert final.usage.cache_read_input_tokens  # the first request wrote the prompt
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_answer_before_it(sdk: Any, door: tuple[Any, Any]) -> None:
    client = _client(sdk, door)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "extra_body": GREEDY}
    kwargs["messages"] = [{"role": "user", "content": "hello world, hello router"}]
    text = client.messages.create(max_tokens=16, **kwargs).content[0].text
    # A character past the first (the tiny model's text has stray bytes: not those).
    chars = [c for c in text[1:] if c != "\ufffd" and not c.isspace()]
    assert chars, f"no stop string to pick from the answer {text!r}"
    stop = chars[0]
    reply = client.messages.create(max_tokens=16, stop_sequences=[stop], **kwargs)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.find(stop)]


def _refused(door: tuple[Any, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = call(door[1], "POST", "/v1/messages", body, {"x-api-key": KEY})
    return status, json.loads(raw)


def test_bad_requests_get_anthropics_error_naming_the_field(door: tuple[Any, Any]) -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    user = {"role": "user", "content": "hi"}
    cases = {
        "messages[1].content[0].cache_control": {
            "system": [block] * 3,
            "messages": [
                {"role": "user", "content": [block]},
                {"role": "user", "content": [block]},
            ],
        },
        "system[0].cache_control.ttl": {
            "system": [{**block, "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
            "messages": [user],
        },
        "system[0].cache_control.type": {
            "system": [{**block, "cache_control": {"type": "forever"}}],
            "messages": [user],
        },
        "max_tokens": {"messages": [user], "max_tokens": None},
        "messages[0].role": {"messages": [{"role": "robot", "content": "hi"}]},
    }
    for field, body in cases.items():
        status, payload = _refused(door, {"model": MODEL_NAME, "max_tokens": 4, **body})
        assert status == 400, payload
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        assert field in payload["error"]["message"], (field, payload)


def test_the_sdk_raises_anthropics_exceptions(sdk: Any, door: tuple[Any, Any]) -> None:
    user = {"role": "user", "content": "hi"}
    with pytest.raises(sdk.BadRequestError, match="cache_control.ttl"):
        _client(sdk, door).messages.create(
            model=MODEL_NAME, max_tokens=4, system=_system("bad", ttl="1d"), messages=[user]
        )
    with pytest.raises(sdk.AuthenticationError):
        _client(sdk, door, key="wrong").messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[user]
        )
    with pytest.raises(sdk.NotFoundError):
        _client(sdk, door).messages.create(model="claude-x", max_tokens=4, messages=[user])
    # The door still serves.
    reply = _client(sdk, door).messages.create(model=MODEL_NAME, max_tokens=2, messages=[user])
    assert reply.content


def test_usage_adds_up_on_the_grpc_and_openai_doors(door: tuple[Any, Any]) -> None:
    server, http = door
    stub = pb_grpc.InferenceStub(server.channel())
    prompt = pb.Prompt(chat=pb.ChatMessages(messages=_chat("grpc", "a gRPC question")))
    sampling = pb.SamplingParams(max_tokens=3, temperature=0.0)
    usages = []
    for _ in range(2):
        request = pb.GenerateRequest(prompt=prompt, sampling=sampling)
        replies = list(stub.Generate(request, metadata=AUTH, timeout=120))
        usages.append(replies[-1].usage)
    num_prompt = _num_prompt_tokens(server, "grpc", "a gRPC question")
    for usage in usages:
        read = sum(usage.cached_tokens.values())
        assert usage.prompt_tokens == num_prompt
        assert 0 <= usage.prompt_tokens - read - usage.cache_write_tokens < num_prompt
    assert usages[0].cache_write_tokens > 0 and usages[1].cached_tokens
    # The openai SDK, with OpenAI's cache controls.
    client = openai.OpenAI(base_url=base_url(http), api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=3,
        messages=[{"role": m.role, "content": m.content} for m in _chat("grpc", "openai")],
        prompt_cache_key="user-7",
        prompt_cache_retention="24h",
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    details = reply.usage.prompt_tokens_details
    by_tier = details.model_extra["cached_tokens_by_tier"]  # type: ignore[index]
    written = details.cache_write_tokens or 0  # OpenAI's own field
    assert details.cached_tokens == sum(by_tier.values()) > 0
    uncached = reply.usage.prompt_tokens - details.cached_tokens - written
    assert 0 <= uncached < reply.usage.prompt_tokens
    assert reply.usage.prompt_tokens == _num_prompt_tokens(server, "grpc", "openai")
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        client.chat.completions.create(
            model=MODEL_NAME,
            max_tokens=3,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"prompt_cache_retention": "forever"},
        )


def test_an_affinity_key_keeps_its_requests_on_its_worker(
    door: tuple[Any, Any], make_server: Any
) -> None:
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0)

    def worker_of(server: Any, text: str, key: str | None = None) -> str:
        request = pb.GenerateRequest(prompt=pb.Prompt(text=text), sampling=sampling)
        if key is not None:
            request.affinity_key = key
        stub = pb_grpc.InferenceStub(server.channel())
        replies = list(stub.Generate(request, metadata=AUTH, timeout=120))
        return str(replies[-1].usage.worker_id)

    # Long prompts held by each worker: the module's router spreads new prompts once one
    # worker got more than its share of them (its traffic bound).
    held: dict[str, str] = {}
    for i in range(12):
        prompt = f"{i} " + " ".join(["the quick brown fox jumps over the lazy dog."] * 4)
        held.setdefault(worker_of(door[0], prompt), prompt)
        if len(held) == 2:
            break
    assert len(held) == 2, "every prompt went to one worker"
    (x, on_x), (y, on_y) = held.items()
    # A router of its own (fresh memory of recent traffic, its bound off): the key's first
    # request goes to the holder of its prefix, y.
    server = make_server(auth_token=KEY, balance_traffic_factor=0)
    assert worker_of(server, on_y + " one", "user-42") == y
    # Without the key a continuation of x's prompt goes to x; with it, to the key's worker.
    assert worker_of(server, on_x + " two") == x
    assert worker_of(server, on_x + " three", "user-42") == y
