"""Anthropic Messages bodies -> GenerateInput: system and messages as chat turns, sampling,
cache_control breakpoints (at most 4, known ttls, longer before shorter) asking the prompt up to
the last one to be retained for the longest ttl, and every refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from router.domain import ChatMessage, InvalidInput, PromptInput
from router.http.errors import param_of
from router.http.messages_parse import parse_messages

EPHEMERAL = {"type": "ephemeral"}


def _parse(**body: Any) -> Any:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_messages({"model": "m", "max_tokens": 8, **body}, "rid")


def _block(text: str, **control: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if control:
        block["cache_control"] = control
    return block


def test_system_blocks_and_messages_become_chat_turns() -> None:
    req = _parse(
        system=[_block("be brief", **EPHEMERAL), _block("be kind")],
        messages=[
            {"role": "user", "content": [_block("a"), _block("b", type="ephemeral", ttl="5m")]},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ],
        temperature=0.3,
        top_p=0.5,
        top_k=7,
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
    )
    assert req.input.prompt.messages == (
        ChatMessage("system", "be brief\nbe kind"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", "c"),
        ChatMessage("user", "d"),
    )
    p = req.input.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (8, 0.3, 0.5, 7, ("END",))
    assert req.input.max_tokens_set and req.input.prompt.add_generation_prompt
    assert [b.field for b in req.breakpoints] == [
        "system[0].cache_control",
        "messages[0].content[1].cache_control",
    ]
    assert req.input.retention_s == 300  # 5 minutes is the default ttl
    # Retained: the chat up to the last breakpoint (the first user turn), no generation prompt.
    assert req.retention_prefix == PromptInput(
        messages=(ChatMessage("system", "be brief\nbe kind"), ChatMessage("user", "a\nb")),
        add_generation_prompt=False,
    )
    assert not req.stream and req.model == "m"


@pytest.mark.parametrize(
    ("ttls", "retention_s"),
    [((), None), (("5m",), 300), (("1h",), 3600), (("1h", "1h", "5m", None), 3600)],
)
def test_the_longest_ttl_is_the_retention(ttls: tuple[Any, ...], retention_s: Any) -> None:
    blocks = [_block(str(i), type="ephemeral", ttl=t) for i, t in enumerate(ttls)]
    req = _parse(messages=[{"role": "user", "content": blocks or "hi"}])
    assert req.input.retention_s == retention_s
    assert [b.ttl_s for b in req.breakpoints] == [3600 if t == "1h" else 300 for t in ttls]
    assert req.retention_prefix is None  # the last breakpoint ends the prompt: all of it


def test_the_retained_part_ends_at_the_last_breakpoint() -> None:
    req = _parse(
        system=[_block("s0"), _block("s1", **EPHEMERAL), _block("s2")],
        messages=[{"role": "user", "content": "q"}],
    )
    assert req.retention_prefix == PromptInput(
        messages=(ChatMessage("system", "s0\ns1"),), add_generation_prompt=False
    )
    later = _parse(
        system=[_block("s", ttl="1h", type="ephemeral")],
        messages=[
            {"role": "user", "content": [_block("u0", **EPHEMERAL), _block("u1")]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q"},
        ],
    )
    assert later.input.retention_s == 3600
    assert later.retention_prefix == PromptInput(
        messages=(ChatMessage("system", "s"), ChatMessage("user", "u0")),
        add_generation_prompt=False,
    )


def test_metadata_user_id_is_no_session() -> None:
    req = _parse(metadata={"user_id": "u1"}, system=[_block("s", **EPHEMERAL)])
    assert req.input.session_id is None


def test_top_level_cache_control_is_a_breakpoint() -> None:
    req = _parse(system="s", cache_control={"type": "ephemeral", "ttl": "1h"})
    assert [b.field for b in req.breakpoints] == ["cache_control"]
    assert req.input.retention_s == 3600
    assert req.retention_prefix is None


def _four_then(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "system": [_block("s", **EPHEMERAL)],
        "messages": [{"role": "user", "content": [_block(str(i), **EPHEMERAL) for i in range(3)]}]
        + [{"role": "assistant", "content": "x"}, {"role": "user", "content": [extra]}],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_four_then(_block("fifth", **EPHEMERAL)), "messages[2].content[0].cache_control"),
        ({"cache_control": {"type": "ephemeral", "ttl": "10m"}}, "cache_control.ttl"),
        ({"system": [_block("s", type="ephemeral", ttl=300)]}, "system[0].cache_control.ttl"),
        ({"system": [_block("s", type="persistent")]}, "system[0].cache_control.type"),
        ({"system": [_block("s", type="ephemeral", scope="org")]}, "system[0].cache_control.scope"),
        (
            {"system": [_block("a", type="ephemeral"), _block("b", type="ephemeral", ttl="1h")]},
            "system[1].cache_control.ttl",
        ),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}, None),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, None),
        ({"system": 3}, "system"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"stream": "yes"}, "stream"),
        ({"metadata": {"session": "x"}}, "metadata.session"),
        ({"tools": [{"name": "f"}]}, "tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidInput) as info:
        _parse(**body)
    message = str(info.value)
    if param is not None:
        assert param_of(message) == param, message
    else:  # the field is deeper than the message's first words: it is named all the same
        assert "messages[1].role" in message or "content[0].text" in message, message


def test_fields_that_ask_for_nothing_are_accepted() -> None:
    req = _parse(tools=[], thinking={"type": "disabled"}, service_tier="auto", cache_control=None)
    assert req.breakpoints == ()
