"""OpenAI request bodies -> GenerateInput: the fields map as vLLM maps them, and every field we
do not serve is refused by name unless its value asks for nothing."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import RouterConfig
from router.domain import ChatMessage, InvalidInput, PromptInput
from router.http.parse import parse_chat, parse_completion

CONFIG = RouterConfig()
CONTEXT = 2048


def _completion(**body: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "hi", **body}, CONFIG, "rid")


def _chat(**body: Any) -> Any:
    messages = [{"role": "user", "content": "hi"}]
    return parse_chat({"model": "m", "messages": messages, **body}, CONFIG, "rid", CONTEXT)


def test_sampling_fields_map_as_vllm_maps_them() -> None:
    req = _completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=3,
        seed=11,
        stop="END",
        top_k=-1,
        ignore_eos=True,
        stop_token_ids=[5],
        cache_salt="s1",
        user="alice",
    )
    (inp,) = req.inputs
    p = inp.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed) == (7, 0.5, 0.9, 3, 11)
    assert p.stop == ("END",) and p.stop_token_ids == (5,)
    assert p.top_k == 0, "top_k -1 (vLLM's off) is our 0"
    assert p.ignore_eos and inp.cache_salt == "s1"
    assert inp.prompt == PromptInput(text="hi") and req.n == 3 and not req.chat


def test_defaults_are_openais() -> None:
    assert _completion().inputs[0].params.max_tokens == 16
    assert _chat().inputs[0].params.max_tokens == CONTEXT, "chat runs to the context"
    assert _chat().inputs[0].params.temperature == 1.0
    # max_completion_tokens wins over the deprecated max_tokens, as in vLLM.
    assert _chat(max_tokens=9, max_completion_tokens=4).inputs[0].params.max_tokens == 4


def test_stream_options_include_usage_only_when_streaming() -> None:
    assert _chat(stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(InvalidInput, match="stream_options is allowed only when stream"):
        _chat(stream_options={"include_usage": True})
    with pytest.raises(InvalidInput, match="stream_options.continuous_usage_stats"):
        _chat(stream=True, stream_options={"continuous_usage_stats": True})


def test_chat_messages_and_text_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": parts}]
    req = parse_chat({"messages": messages}, CONFIG, "rid", CONTEXT)
    assert req.inputs[0].prompt.messages == (
        ChatMessage("system", "sys"),
        ChatMessage("user", "a\nb"),
    )
    assert req.model is None, "model is optional, as in vLLM"


def test_completion_prompt_forms_and_batches() -> None:
    assert _completion(prompt=[1, 2, 3]).inputs[0].prompt == PromptInput(token_ids=(1, 2, 3))
    batch = _completion(prompt=["a", [4, 5]], n=2)
    assert [i.prompt for i in batch.inputs] == [
        PromptInput(text="a"),
        PromptInput(token_ids=(4, 5)),
    ]
    assert [i.request_id for i in batch.inputs] == ["rid-0", "rid-1"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content[0]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 99}, "n must be in"),
        ({"n": True}, "n must be an integer"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": 3}, "stop must be"),
        ({"stream": "yes"}, "stream must be a boolean"),
        ({"messages": []}, "messages must be a non-empty array"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"beam_width": 2, "n": 2}, "n must be 1 with beam search"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "got array"),
        ({"temperature": 10**400}, "temperature must be a finite number"),
        ({"skip_special_tokens": False}, "skip_special_tokens must be true"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens must be"),
        ({"add_special_tokens": True}, "add_special_tokens must be false on chat"),
        ({"request_id": "a\r\nb"}, "request_id must hold no control characters"),
        ({"request_id": "\u8bf7"}, "request_id must be latin-1"),
        ({"x" * 5000: 1}, "x" * 64 + r"\.\.\. is not supported"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput, match=named.replace("[", r"\[").replace("]", r"\]")):
        _chat(**body)


@pytest.mark.parametrize(
    "body",
    [
        {"logprobs": False},
        {"logprobs": None},
        {"tools": []},
        {"tool_choice": "none"},
        {"frequency_penalty": 0},
        {"presence_penalty": 0.0},
        {"logit_bias": {}},
        {"best_of": 1},
        {"parallel_tool_calls": True},
        {"response_format": None},
        {"stop": None},
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(body: dict[str, Any]) -> None:
    _chat(**body)


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        (None, "prompt must be"),
        ([], "prompt must be"),
        (["a", []], "prompt[1]"),
        ([True], "prompt"),
    ],
)
def test_bad_prompts(prompt: Any, named: str) -> None:
    with pytest.raises(InvalidInput, match=named.replace("[", r"\[").replace("]", r"\]")):
        _completion(prompt=prompt)


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidInput, match="the request body must be a JSON object"):
        parse_completion([1, 2], CONFIG, "rid")
    with pytest.raises(InvalidInput, match="echo"):
        _completion(echo=True)


def test_only_a_max_tokens_the_client_set_is_held_to_the_context() -> None:
    assert not _chat().inputs[0].max_tokens_set, "the default is lowered to fit"
    assert not _completion(max_tokens=None).inputs[0].max_tokens_set
    assert _completion(max_tokens=5).inputs[0].max_tokens_set
    assert _chat(max_tokens=None, max_completion_tokens=5).inputs[0].max_tokens_set


def test_special_token_options_as_vllm_serves_them() -> None:
    assert not _completion(add_special_tokens=False).add_special_tokens
    assert _completion(add_special_tokens=True).add_special_tokens
    _chat(add_special_tokens=False, skip_special_tokens=True)
    _completion(spaces_between_special_tokens=True)
    with pytest.raises(InvalidInput, match="skip_special_tokens must be true"):
        _completion(skip_special_tokens=False)
