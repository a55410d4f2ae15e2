"""Anthropic Messages request bodies (`POST /v1/messages`) -> the router's `GenerateInput`;
every refusal names the body field.

The fields as Anthropic documents them: `model` and `max_tokens` (both required), `system` (a
string or text blocks), `messages` (role `user` or `assistant`, content a string or text
blocks; a final `assistant` turn, a prefilled answer, is refused), `temperature` (0 to 1),
`top_p`, `top_k`, `stop_sequences`, `stream` and `metadata.user_id` (accepted; it changes
nothing). Any other field is refused unless its value asks for nothing (`tools: []`,
`thinking: {"type": "disabled"}`, ...), as on the OpenAI endpoints.

Prompt caching: `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a system block, on
a message's content block, or at the top level (Anthropic's automatic caching: a breakpoint at
the last block), at most `MAX_BREAKPOINTS` in a request, a longer ttl never after a shorter one.
This server caches every full block of every prompt whatever the breakpoints say, and reports
what it read and wrote (`router.http.messages_render`). With breakpoints, the prompt up to the
last one is retained (soft: `cachesvc.kv.retention`) for the longest ttl asked
(`GenerateInput.retention_s`); `MessagesRequest.retention_prefix` is that part of the chat, which
the door counts in tokens (`GenerateInput.retention_tokens`). `metadata.user_id` is no cache
session.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from router.domain import ChatMessage, GenerateInput, InvalidInput, PromptInput
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

MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control in one request
TTL_S = {"5m": 300, "1h": 3600}  # Anthropic's cache_control ttls
DEFAULT_TTL = "5m"
ROLES = ("user", "assistant")
_MAX_STOP_SEQUENCES = 16  # as the other doors' stop strings
_MAX_USER_ID_LEN = 256
_FIELDS = frozenset(
    (
        "model",
        "max_tokens",
        "messages",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "metadata",
        "cache_control",
    )
)
_NEUTRAL = {
    "thinking": lambda v, _: isinstance(v, dict) and v.get("type") == "disabled",
    "tool_choice": lambda v, body: (
        isinstance(v, dict) and v.get("type") in ("auto", "none") and not body.get("tools")
    ),
    "service_tier": lambda v, _: v in ("auto", "standard_only"),
}
_BLOCK_FIELDS = frozenset(("type", "text", "cache_control"))


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` of the request: where it sits (its field) and its ttl in seconds; and,
    for one on a content block, that block: `source` -1 for `system`, i for `messages[i]`
    (None: the top level's, the end of the prompt), `block` its index there."""

    field: str
    ttl_s: int
    source: int | None = None
    block: int = 0


@dataclass(frozen=True)
class MessagesRequest:
    """A parsed Messages request: the one `GenerateInput` it makes, and its breakpoints in
    the order Anthropic reads them (system, then messages, then the top level's)."""

    model: str
    input: GenerateInput
    stream: bool
    breakpoints: tuple[Breakpoint, ...]
    # The chat up to the last breakpoint, when it ends before the prompt does; None: the
    # whole prompt is retained (or nothing, without breakpoints).
    retention_prefix: PromptInput | None = None


def parse_messages(body: Any, request_id: str) -> MessagesRequest:
    """A `/v1/messages` body; raises InvalidInput naming the field. `request_id` names the
    request (the door's, from the x-request-id header or made up)."""
    body = json_object(body)
    check_fields(body, _FIELDS, _NEUTRAL)
    model = body.get("model")
    check(isinstance(model, str) and bool(model), "model is required: a non-empty string")
    breakpoints: list[Breakpoint] = []
    chat = _system(body.get("system"), breakpoints)
    has_system = bool(chat)
    chat += _messages(body.get("messages"), breakpoints)
    if body.get("cache_control") is not None:
        breakpoints.append(_cache_control(body["cache_control"], "cache_control"))
    _check_breakpoints(breakpoints)
    _metadata(body.get("metadata"))
    check_header_id(request_id)
    generate = GenerateInput(
        request_id=request_id,
        prompt=PromptInput(messages=tuple(chat)),
        params=_sampling(body),
        max_tokens_set=True,
        retention_s=max((b.ttl_s for b in breakpoints), default=None),
    )
    stream = typed(body, "stream", bool, False)
    prefix = _retention_prefix(body, chat, has_system, breakpoints[-1]) if breakpoints else None
    return MessagesRequest(model, generate, stream, tuple(breakpoints), prefix)


def _retention_prefix(
    body: dict[str, Any], chat: list[ChatMessage], has_system: bool, last: Breakpoint
) -> PromptInput | None:
    """The chat up to and including the block of the `last` breakpoint: the messages before
    it and its message's blocks up to it (joined as `_text` joins them), with no generation
    prompt; None when that is the whole prompt, or the breakpoint is on an empty system."""
    if last.source is None:
        return None
    if last.source < 0:
        if not has_system:
            return None
        at, blocks = 0, body["system"]
    else:
        at, blocks = last.source + has_system, body["messages"][last.source]["content"]
    if at == len(chat) - 1 and last.block == len(blocks) - 1:
        return None
    content = "\n".join(b["text"] for b in blocks[: last.block + 1])
    messages = (*chat[:at], ChatMessage(chat[at].role, content))
    return PromptInput(messages=messages, add_generation_prompt=False)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    max_tokens = integer(body, "max_tokens")
    check(max_tokens is not None, "max_tokens is required: an integer >= 1")
    check(max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}")
    temperature = number(body, "temperature", 1.0)
    top_p = number(body, "top_p", 1.0)
    top_k = integer(body, "top_k", 0)
    check(0 <= temperature <= 1, f"temperature must be in [0, 1], got {temperature:g}")
    check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p:g}")
    check(top_k >= 0, f"top_k must be >= 0 (0: off), got {top_k}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=_stop_sequences(body.get("stop_sequences")),
        )
    except ValueError as exc:  # a rule of the engine's that the checks above do not cover
        raise InvalidInput(str(exc)) from exc


def _system(value: Any, breakpoints: list[Breakpoint]) -> list[ChatMessage]:
    """`system`: a string or text blocks; none when absent or empty."""
    if value is None:
        return []
    text = _text(value, "system", breakpoints, -1)
    return [ChatMessage("system", text)] if text else []


def _messages(value: Any, breakpoints: list[Breakpoint]) -> list[ChatMessage]:
    check(isinstance(value, list) and bool(value), "messages is required: a non-empty array")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        m = json_object(m, where)
        check_fields(m, frozenset(("role", "content")), prefix=f"{where}.")
        role = str(m.get("role"))
        check(
            role in ROLES,
            f"{where}.role must be 'user' or 'assistant', got {shown(m.get('role'))} (a system "
            "prompt is the top-level system field)",
        )
        content = _text(m.get("content"), f"{where}.content", breakpoints, i)
        out.append(ChatMessage(role, content))
    last = len(value) - 1
    check(
        value[last]["role"] == "user",
        f"messages[{last}].role must be 'user': a final assistant turn (a prefilled answer) "
        "is not supported by this server",
    )
    return out


def _text(value: Any, where: str, breakpoints: list[Breakpoint], source: int) -> str:
    """A string, or text blocks (joined by newlines), collecting their breakpoints (of
    `source`, as `Breakpoint.source` counts)."""
    if isinstance(value, str):
        return value
    check(isinstance(value, list), f"{where} must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        block = json_object(block, at)
        kind = block.get("type")
        check(
            kind == "text",
            f"{at}.type must be 'text': this server serves text only, got {shown(kind)}",
        )
        check_fields(block, _BLOCK_FIELDS, prefix=f"{at}.")
        text = typed(block, "text", str, None, f"{at}.")
        check(text is not None, f"{at}.text is required: a string")
        if block.get("cache_control") is not None:
            mark = _cache_control(block["cache_control"], f"{at}.cache_control")
            breakpoints.append(dataclasses.replace(mark, source=source, block=j))
        texts.append(text)
    return "\n".join(texts)


def _cache_control(value: Any, where: str) -> Breakpoint:
    control = json_object(value, where)
    check_fields(control, frozenset(("type", "ttl")), prefix=f"{where}.")
    kind = control.get("type")
    check(kind == "ephemeral", f"{where}.type must be 'ephemeral', got {shown(kind)}")
    ttl = control.get("ttl")
    ttl = DEFAULT_TTL if ttl is None else ttl
    check(ttl in TTL_S, f"{where}.ttl must be '5m' or '1h', got {shown(ttl)}")
    return Breakpoint(where, TTL_S[ttl])


def _check_breakpoints(breakpoints: list[Breakpoint]) -> None:
    """At most `MAX_BREAKPOINTS`; a longer ttl never after a shorter one (Anthropic's rule:
    a prefix kept an hour cannot end after one kept five minutes)."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        extra = breakpoints[MAX_BREAKPOINTS].field
        raise InvalidInput(
            f"{extra} is a cache breakpoint too many: at most {MAX_BREAKPOINTS} blocks may "
            f"have cache_control in a request, this one has {len(breakpoints)}"
        )
    for before, after in zip(breakpoints, breakpoints[1:], strict=False):
        check(
            after.ttl_s <= before.ttl_s,
            f"{after.field}.ttl is longer than that of {before.field}: a breakpoint with a "
            "longer ttl must come before those with a shorter one",
        )


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return stop_strings(value, "stop_sequences", _MAX_STOP_SEQUENCES, "an array of strings")


def _metadata(value: Any) -> None:
    """`metadata`: only `user_id`, a string (Anthropic's abuse tracking; nothing here)."""
    if value is None:
        return
    metadata = json_object(value, "metadata")
    check_fields(metadata, frozenset(("user_id",)), prefix="metadata.")
    user_id = typed(metadata, "user_id", str, None, "metadata.")
    check(
        user_id is None or len(user_id) <= _MAX_USER_ID_LEN,
        f"metadata.user_id must be at most {_MAX_USER_ID_LEN} characters",
    )
