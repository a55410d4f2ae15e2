"""Anthropic's Messages API on the HTTP door, over real Ray workers: the official `anthropic`
SDK unchanged (non-streaming, streaming, stop sequences, usage, errors), `cache_control`
refusals in Anthropic's shape, and the usage split on every door: read + written + uncached
adds up to the prompt as the router tokenizes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
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


def _client(door: tuple[Any, Any], key: str = KEY) -> anthropic.Anthropic:
    url = base_url(door[1]).removesuffix("/v1")
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


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


def test_sdk_message_usage_adds_up_and_the_second_request_reads(door: tuple[Any, Any]) -> None:
    server, _ = door
    client = _client(door)
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


def test_sdk_stream_is_the_whole_answer_event_by_event(door: tuple[Any, Any]) -> None:
    client = _client(door)
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
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert sum(_split(final.usage)) == sum(_split(whole.usage))
    assert final.usage.cache_read_input_tokens  # the first request wrote the prompt
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_answer_before_it(door: tuple[Any, Any]) -> None:
    client = _client(door)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "extra_body": GREEDY}
    kwargs["messages"] = [{"role": "user", "content": "hello world, hello router"}]
    text = client.messages.create(max_tokens=16, **kwargs).content[0].text  # type: ignore[union-attr]
    # A character past the first (the tiny model's text has stray bytes: not those).
    chars = [c for c in text[1:] if c != "\ufffd" and not c.isspace()]
    assert chars, f"no stop string to pick from the answer {text!r}"
    stop = chars[0]
    reply = client.messages.create(max_tokens=16, stop_sequences=[stop], **kwargs)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.find(stop)]  # type: ignore[union-attr]


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
    with pytest.raises(anthropic.BadRequestError, match="cache_control.ttl"):
        _client(door).messages.create(
            model=MODEL_NAME, max_tokens=4, system=_system("bad", ttl="1d"), messages=[user]
        )  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError):
        _client(door, key="wrong").messages.create(model=MODEL_NAME, max_tokens=4, messages=[user])
    with pytest.raises(anthropic.NotFoundError):
        _client(door).messages.create(model="claude-x", max_tokens=4, messages=[user])
    # The door still serves.
    assert _client(door).messages.create(model=MODEL_NAME, max_tokens=2, messages=[user]).content


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
    body = {
        "model": MODEL_NAME,
        "max_tokens": 3,
        "messages": [{"role": m.role, "content": m.content} for m in _chat("grpc", "openai")],
    }
    status, _, raw = call(http, "POST", "/v1/chat/completions", body, dict(AUTH))
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == sum(details["cached_tokens_by_tier"].values()) > 0
    uncached = usage["prompt_tokens"] - details["cached_tokens"] - details["cache_write_tokens"]
    assert 0 <= uncached < usage["prompt_tokens"]
    assert usage["prompt_tokens"] == _num_prompt_tokens(server, "grpc", "openai")


def test_an_affinity_key_keeps_distinct_prompts_on_one_worker(door: tuple[Any, Any]) -> None:
    server, _ = door
    stub = pb_grpc.InferenceStub(server.channel())
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0)

    def worker_of(text: str, key: str | None) -> str:
        request = pb.GenerateRequest(prompt=pb.Prompt(text=text), sampling=sampling)
        if key is not None:
            request.affinity_key = key
        replies = list(stub.Generate(request, metadata=AUTH, timeout=120))
        return str(replies[-1].usage.worker_id)

    # Prompts sharing no block: without a key, new conversations go where there was least
    # to do lately, so they spread over the two workers.
    spread = {worker_of(f"{word} quick brown fox", None) for word in ("One", "Two", "Six", "Ten")}
    assert len(spread) == 2
    keyed = {worker_of(f"{word} lazy dog", "user-42") for word in ("Red", "Tan", "Sky", "Fig")}
    assert len(keyed) == 1
