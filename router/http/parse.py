"""OpenAI request bodies -> the router's `GenerateInput`s; every refusal names the body field.

The fields map as vLLM's OpenAI server maps them: `max_tokens` (completions default 16, chat
default: up to the model's context), `max_completion_tokens` (wins over `max_tokens`),
`temperature`, `top_p`, `n`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `user`
(accepted; it changes nothing here, as in vLLM); our own extensions sit at the top level of the
body, where vLLM puts its own: `top_k` (-1 or 0: off), `cache_salt`, `ignore_eos`,
`beam_width`, `length_penalty`, `stop_token_ids`, `no_response_cache`, `request_id`,
`return_token_ids` (each choice, or chunk, also carries its `token_ids`, as in vLLM).
OpenAI's prompt cache controls, `prompt_cache_key` and `prompt_cache_retention`, are read by
`router.http.cache_controls`.
vLLM's `add_special_tokens` is honoured (completions: true or false; chat: false, as the
template writes them); `skip_special_tokens` and `spaces_between_special_tokens` only as true
(the answer's text never holds special tokens; `return_token_ids` gives every id).

A `max_tokens` the client sets must fit the context with the prompt (the router refuses it
otherwise, as vLLM does); the default is lowered to what fits.

Any other field is refused (InvalidInput naming it) unless its value asks for nothing: null,
false, an empty string, list or object, or the field's neutral value (a penalty of 0,
`best_of` equal to `n`, ...). So a client asking for `logprobs`, `tools` or `response_format`
is told, never silently served something else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.config import RouterConfig
from router.domain import ChatMessage, GenerateInput, InvalidInput, PromptInput
from router.http.cache_controls import FIELDS as CACHE_FIELDS
from router.http.cache_controls import parse_cache_controls
from router.http.fields import (
    check,
    check_fields,
    integer,
    json_object,
    number,
    shown,
    stop_strings,
    typed,
)
from router.request.ids import check_header_id
from workers.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's
MAX_PROMPTS = 64  # prompts in one completions request (a batch)
_MAX_STOP_STRINGS = 16  # as on the gRPC door
_MAX_SALT_LEN = 256  # as a request id's
_INT64 = 2**63
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's

# Fields we do not serve, accepted only with the value that asks for nothing (beyond the
# generic null / false / empty).
_NEUTRAL: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "frequency_penalty": lambda v, _: v == 0,
    "presence_penalty": lambda v, _: v == 0,
    "repetition_penalty": lambda v, _: v == 1,
    "min_p": lambda v, _: v == 0,
    "min_tokens": lambda v, _: v == 0,
    "best_of": lambda v, body: v == body.get("n", 1),
    "tool_choice": lambda v, body: v in ("none", "auto") and not body.get("tools"),
    "parallel_tool_calls": lambda v, _: isinstance(v, bool),
}
# vLLM's detokenizing options: served only as what this server always does.
_ONLY_TRUE = ("skip_special_tokens", "spaces_between_special_tokens")
_COMMON = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "top_k",
    "cache_salt",
    "ignore_eos",
    "beam_width",
    "length_penalty",
    "stop_token_ids",
    "no_response_cache",
    "request_id",
    "return_token_ids",
    "add_special_tokens",
    *CACHE_FIELDS,
    *_ONLY_TRUE,
)
_COMPLETION_FIELDS = frozenset((*_COMMON, "prompt"))
_CHAT_FIELDS = frozenset((*_COMMON, "messages", "add_generation_prompt"))


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed completions or chat request: one `GenerateInput` per prompt (a completions
    batch has several; their choices are numbered prompt by prompt, `n` each). `request_id` is
    the client's (`request_id`), else empty: the door names the request. Without
    `add_special_tokens` the door tokenizes a text prompt itself, without bos/eos."""

    chat: bool
    model: str | None
    inputs: tuple[GenerateInput, ...]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    add_special_tokens: bool = True


def parse_completion(body: Any, config: RouterConfig, request_id: str) -> OpenAIRequest:
    """A `/v1/completions` body; raises InvalidInput naming the field."""
    body = json_object(body)
    check_fields(body, _COMPLETION_FIELDS, _NEUTRAL)
    prompts = _prompts(body.get("prompt"))
    params = _sampling(body, config, COMPLETIONS_DEFAULT_MAX_TOKENS)
    add_special_tokens = typed(body, "add_special_tokens", bool, True)
    parsed = _request(body, False, prompts, params, request_id)
    return dataclasses.replace(parsed, add_special_tokens=add_special_tokens)


def parse_chat(
    body: Any, config: RouterConfig, request_id: str, max_model_len: int
) -> OpenAIRequest:
    """A `/v1/chat/completions` body; raises InvalidInput naming the field. Without a token
    limit a chat answer may run to the end of the model's context (`max_model_len`)."""
    body = json_object(body)
    check_fields(body, _CHAT_FIELDS, _NEUTRAL)
    messages = _messages(body.get("messages"))
    add_generation_prompt = typed(body, "add_generation_prompt", bool, True)
    check(
        not typed(body, "add_special_tokens", bool, False),
        "add_special_tokens must be false on chat completions: the chat template writes the "
        "model's special tokens (as in vLLM)",
    )
    prompt = PromptInput(messages=messages, add_generation_prompt=add_generation_prompt)
    params = _sampling(body, config, max_model_len)
    return _request(body, True, [prompt], params, request_id)


def _request(
    body: dict[str, Any],
    chat: bool,
    prompts: list[PromptInput],
    params: SamplingParams,
    request_id: str,
) -> OpenAIRequest:
    stream = typed(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidInput("stream_options is allowed only when stream is true")
    options = json_object(options or {}, "stream_options")
    check_fields(options, frozenset(("include_usage",)), prefix="stream_options.")
    typed(body, "user", str, None)
    for name in _ONLY_TRUE:
        check(
            typed(body, name, bool, True),
            f"{name} must be true: this server always leaves special tokens out of the "
            "answer's text (return_token_ids gives every token id)",
        )
    salt = typed(body, "cache_salt", str, None)
    request_id = typed(body, "request_id", str, None) or request_id
    check_header_id(request_id)
    if salt is not None and len(salt) > _MAX_SALT_LEN:
        raise InvalidInput(f"cache_salt is {len(salt)} characters; at most {_MAX_SALT_LEN}")
    use_cache = not typed(body, "no_response_cache", bool, False)
    controls = parse_cache_controls(body)
    inputs = tuple(
        GenerateInput(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            prompt=prompt,
            params=params,
            cache_salt=salt,
            use_response_cache=use_cache,
            max_tokens_set=body.get(_max_tokens_field(body)) is not None,
            retention_s=controls.retention_s,
            affinity_key=controls.affinity_key,
            explain_cache=controls.explain,
        )
        for i, prompt in enumerate(prompts)
    )
    return OpenAIRequest(
        chat=chat,
        model=typed(body, "model", str, None),
        inputs=inputs,
        n=1 if params.beam_width > 1 else params.n,
        stream=stream,
        include_usage=typed(options, "include_usage", bool, False, "stream_options."),
        return_token_ids=typed(body, "return_token_ids", bool, False),
    )


def _sampling(
    body: dict[str, Any], config: RouterConfig, default_max_tokens: int
) -> SamplingParams:
    field = _max_tokens_field(body)
    max_tokens = integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    check(max_tokens >= 1, f"{field} must be >= 1, got {max_tokens}")
    temperature = number(body, "temperature", 1.0)
    top_p = number(body, "top_p", 1.0)
    top_k = integer(body, "top_k", 0)
    n = integer(body, "n", 1)
    beam_width = integer(body, "beam_width", 1)
    seed = integer(body, "seed")
    check(temperature >= 0, f"temperature must be >= 0, got {temperature:g}")
    check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p:g}")
    check(top_k >= -1, f"top_k must be >= -1 (-1 or 0: off), got {top_k}")
    check(1 <= n <= config.max_n, f"n must be in [1, {config.max_n}], got {n}")
    check(
        1 <= beam_width <= config.max_beam_width,
        f"beam_width must be in [1, {config.max_beam_width}], got {beam_width}",
    )
    check(seed is None or -_INT64 <= seed < _INT64, f"seed must fit in 64 bits, got {seed}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=max(top_k, 0),
            top_p=top_p,
            seed=seed,
            stop=_stop(body.get("stop")),
            stop_token_ids=_token_ids(body.get("stop_token_ids", []), "stop_token_ids"),
            ignore_eos=typed(body, "ignore_eos", bool, False),
            n=n,
            beam_width=beam_width,
            length_penalty=number(body, "length_penalty", 1.0),
        )
    except ValueError as exc:  # a rule of the engine's that the checks above do not cover
        raise InvalidInput(str(exc)) from exc


def _max_tokens_field(body: dict[str, Any]) -> str:
    """The field that sets the token limit (`max_completion_tokens` wins, as in vLLM); the
    limit is set when that field is present and not null."""
    return (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )


def _prompts(value: Any) -> list[PromptInput]:
    """`prompt`: a string, token ids, or a batch (a list of either)."""
    if isinstance(value, str):
        return [PromptInput(text=value)]
    if not isinstance(value, list) or not value:
        raise InvalidInput("prompt must be a string, an array of token ids, or an array of those")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [PromptInput(token_ids=tuple(value))]
    check(len(value) <= MAX_PROMPTS, f"prompt has {len(value)} prompts; at most {MAX_PROMPTS}")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(PromptInput(text=item))
        elif isinstance(item, list) and item:
            prompts.append(PromptInput(token_ids=_token_ids(item, f"prompt[{i}]")))
        else:
            raise InvalidInput(f"prompt[{i}] must be a string or a non-empty array of token ids")
    return prompts


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages must be a non-empty array")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        m = json_object(m, where)
        check_fields(m, frozenset(("role", "content")), prefix=f"{where}.")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{where}.role must be one of {', '.join(ROLES)}; got {shown(role)}")
        messages.append(ChatMessage(role, _content(m.get("content"), f"{where}.content")))
    return tuple(messages)


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidInput(f"{where} must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(value):
        part = json_object(part, f"{where}[{j}]")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = shown(part.get("type"))
            raise InvalidInput(f"{where}[{j}]: only text parts are supported, got type {kind}")
        texts.append(part["text"])
    return "\n".join(texts)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    return stop_strings(stops, "stop", _MAX_STOP_STRINGS, "a string or an array of strings")


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )
    check(ok, f"{field} must be an array of integers")
    return tuple(value)
