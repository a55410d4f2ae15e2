"""The prompt cache controls on both doors: OpenAI's `prompt_cache_key` and
`prompt_cache_retention` (chat and completions), gRPC's `affinity_key` and `retention_s`, carried
on the request as its affinity key and retention; bad values refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.domain import InvalidInput
from router.grpc.wire import delta_to_proto, generate_from_proto
from router.http.errors import param_of
from router.http.parse import parse_chat, parse_completion
from workers.protocol import StreamDelta, Usage

CONFIG = RouterConfig()


def _chat(**body: Any) -> Any:
    messages = [{"role": "user", "content": "hi"}]
    return parse_chat({"messages": messages, **body}, CONFIG, "rid", 2048).inputs[0]


def _completion(**body: Any) -> Any:
    return parse_completion({"prompt": "hi", **body}, CONFIG, "rid").inputs[0]


@pytest.mark.parametrize("parse", [_chat, _completion])
@pytest.mark.parametrize(
    ("body", "key", "retention_s"),
    [
        ({}, None, None),
        ({"prompt_cache_key": "user-42"}, "user-42", None),
        ({"prompt_cache_key": "k" * 1024, "prompt_cache_retention": "24h"}, "k" * 1024, 86400),
        ({"prompt_cache_retention": "in_memory"}, None, None),
        ({"prompt_cache_key": "", "prompt_cache_retention": None}, None, None),
    ],
)
def test_openai_controls_are_carried(
    parse: Any, body: dict[str, Any], key: str | None, retention_s: int | None
) -> None:
    inp = parse(**body)
    assert (inp.affinity_key, inp.retention_s) == (key, retention_s)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
        ({"prompt_cache_retention": "in-memory"}, "prompt_cache_retention"),
        ({"prompt_cache_retention": 24}, "prompt_cache_retention"),
        ({"prompt_cache_options": {"ttl": "30m"}}, "prompt_cache_options"),
    ],
)
def test_openai_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    for parse in (_chat, _completion):
        with pytest.raises(InvalidInput) as info:
            parse(**body)
        assert param_of(str(info.value)) == param, str(info.value)


def _grpc(**fields: Any) -> Any:
    prompt = pb.Prompt(text="hi")
    return generate_from_proto(pb.GenerateRequest(prompt=prompt, **fields), CONFIG)


def test_grpc_controls_are_carried_and_checked() -> None:
    assert (_grpc().affinity_key, _grpc().retention_s) == (None, None)
    inp = _grpc(affinity_key="user-42", retention_s=3600)
    assert (inp.affinity_key, inp.retention_s) == ("user-42", 3600)
    assert _grpc(retention_s=0).retention_s is None
    for fields, name in [
        ({"affinity_key": "k" * 1025}, "affinity_key"),
        ({"retention_s": -1}, "retention_s"),
        ({"retention_s": 86401}, "retention_s"),
    ]:
        with pytest.raises(InvalidInput, match=f"^{name} "):
            _grpc(**fields)


def test_grpc_usage_carries_cache_writes() -> None:
    usage = Usage(20, 1, {"hbm": 8, "dram": 4}, 8, 1.0, None, "w0", cache_write_tokens=4)
    out = delta_to_proto("r", StreamDelta(0, (1,), "x", "stop", usage)).usage
    assert dict(out.cached_tokens) == {"hbm": 8, "dram": 4}
    assert out.cache_write_tokens == 4
