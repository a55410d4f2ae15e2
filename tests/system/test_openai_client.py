"""The official `openai` client against the HTTP door over real Ray workers: chat and
completions, sync and async, streaming and not, `n > 1`, `stop`, tenants and refused fields;
greedy tokens are those of gRPC and of the offline engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from http_support import MODEL_NAME, base_url, start_http, stop_http

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.tenants import TenantToken
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.system

OPERATOR = "operator-token"
TENANTS = (TenantToken("acme", "acme-token"), TenantToken("globex", "globex-token"))
SYSTEM = "A shared system prompt is cached once and reused by every request of its group."


@pytest.fixture(scope="module")
def door(make_server: Any) -> Iterator[tuple[Any, Any]]:
    server = make_server(auth_token=OPERATOR, tenant_tokens=TENANTS)
    http = start_http(server)
    yield server, http
    stop_http(server, http)


def _client(door: tuple[Any, Any], key: str = OPERATOR) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(door[1]), api_key=key, max_retries=0, timeout=120)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _grpc_chat_tokens(server: Any, question: str, max_tokens: int) -> list[int]:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in _messages(question)])
    request = pb.GenerateRequest(
        prompt=pb.Prompt(chat=chat),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    stub = pb_grpc.InferenceStub(server.channel())
    metadata = [("authorization", f"Bearer {OPERATOR}")]
    return [t for m in stub.Generate(request, metadata=metadata, timeout=120) for t in m.token_ids]


def test_greedy_completion_is_the_offline_engines(
    door: tuple[Any, Any], engine_config: EngineConfig
) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    offline = Engine(engine_config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = list(offline.generate([text], greedy)[0].token_ids)
    extra = {"ignore_eos": True, "return_token_ids": True}
    reply = _client(door).completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=12, temperature=0, extra_body=extra
    )
    (choice,) = reply.choices
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == expected
    assert choice.text == offline.tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.model == MODEL_NAME and reply.id.startswith("cmpl-")


def test_greedy_chat_is_grpcs_streamed_or_not(door: tuple[Any, Any]) -> None:
    server, _ = door
    question = "hello world, hello router"
    expected = _grpc_chat_tokens(server, question, 10)
    client = _client(door)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=_messages(question),
        max_tokens=10,
        temperature=0,
        extra_body=extra,
    )
    (choice,) = whole.choices
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == expected
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=_messages(question),
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_async_streaming_reports_cached_prompt_tokens(door: tuple[Any, Any]) -> None:
    async def ask(client: openai.AsyncOpenAI, question: str) -> tuple[str, Any]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=_messages(question),
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.usage is not None:
                assert chunk.choices == [], "usage comes in a chunk of its own, last"
                usage = chunk.usage
            else:
                text += chunk.choices[0].delta.content or ""
        return text, usage

    async def run() -> list[tuple[str, Any]]:
        client = openai.AsyncOpenAI(base_url=base_url(door[1]), api_key=OPERATOR, max_retries=0)
        first = await ask(client, "what is the cache hit ratio")
        # The same prompt again, three at once: the router sends them where it is cached,
        # unless that worker took more than its share lately (then one goes to the other).
        rest = await asyncio.gather(*(ask(client, "what is the cache hit ratio") for _ in range(3)))
        await client.close()
        return [first, *rest]

    answers = asyncio.run(run())
    for _, usage in answers:
        assert usage is not None and usage.completion_tokens <= 6
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The later requests repeat the first one's prompt: served from the KV cache (all but at
    # most one, which the balance may send to the other worker), with the same text.
    cached = [u.prompt_tokens_details.cached_tokens for _, u in answers]
    assert all(0 <= c <= u.prompt_tokens for c, (_, u) in zip(cached, answers, strict=True))
    assert sum(c >= 4 for c in cached[1:]) >= 2, cached
    assert all(text == answers[0][0] for text, _ in answers[1:])


def test_n_samples_seeded_stream_as_they_return_whole(door: tuple[Any, Any]) -> None:
    client = _client(door)
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "hello world, hello worker",
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 123,
        "n": 3,
        "extra_body": {"ignore_eos": True, "no_response_cache": True},
    }
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert finished == {0, 1, 2}


def test_stop_string_ends_the_answer_before_it(door: tuple[Any, Any]) -> None:
    client = _client(door)
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "Routing sends each request",
        "temperature": 0,
    }
    full = client.completions.create(**args, max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    # Two letters from the second half (the tiny model's text has stray bytes too).
    starts = [i for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].isalpha()]
    assert starts, f"no stop string to pick from the answer {text!r}"
    stop = text[starts[0] : starts[0] + 2]
    cut = client.completions.create(**args, max_tokens=16, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_tenants_have_caches_of_their_own(door: tuple[Any, Any]) -> None:
    prompt = "A tenant's long prompt: " + SYSTEM

    def cached(key: str) -> int:
        reply = _client(door, key).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("acme-token") == 0
    assert cached("acme-token") >= 4, "a tenant's repeat finds its own blocks"
    assert cached("globex-token") == 0, "another tenant never sees them"
    with pytest.raises(openai.AuthenticationError) as err:
        cached("not-a-token")
    assert err.value.status_code == 401
    assert "bearer token" in err.value.message


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"n": 0}, "n must be in"),
    ],
)
def test_unsupported_fields_are_refused_by_name(
    door: tuple[Any, Any], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(door).chat.completions.create(
            model=MODEL_NAME, messages=_messages("hi"), max_tokens=2, **extra
        )
    assert err.value.status_code == 400 and named in err.value.message


def test_unknown_model_is_404_and_models_lists_ours(door: tuple[Any, Any]) -> None:
    client = _client(door)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "gpt-4" in err.value.message


def test_router_limit_is_429_and_requests_are_counted_by_door(make_server: Any) -> None:
    server = make_server(max_inflight=1)
    http = start_http(server)
    try:
        client = openai.OpenAI(base_url=base_url(http), api_key="unused", max_retries=0)
        held = client.completions.create(
            model=MODEL_NAME,
            prompt=[9, 8, 7, 6],
            max_tokens=480,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(held))
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert "limit of 1 requests" in err.value.message
        held.close()
        requests = server.router.metrics.requests
        assert requests.labels("http", "Completions", "RESOURCE_EXHAUSTED")._value.get() == 1
        assert requests.labels("grpc", "Generate", "RESOURCE_EXHAUSTED")._value.get() == 0
    finally:
        stop_http(server, http)
    with pytest.raises(grpc.RpcError):  # the gRPC door stays as it was
        list(pb_grpc.InferenceStub(server.channel()).Generate(pb.GenerateRequest(), timeout=30))
