"""Explicit cache controls on every door: gRPC's session_id, skip_cache_read/write,
explain_cache and retention_tokens; the OpenAI endpoints' extensions; the prewarm body; the
hints a worker is given and the usage a client is told. Bad values refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.domain import GenerateInput, InvalidInput, PromptInput
from router.grpc.admin_service import quota_from_proto
from router.grpc.wire import delta_to_proto, generate_from_proto, prewarm_from_proto
from router.http.cache_endpoints import parse_prewarm
from router.http.errors import param_of
from router.http.parse import parse_chat, parse_completion
from router.request.cache_hints import cache_hints
from router.request.prewarm import prewarm_request, prewarm_result
from router.tenants import TenantLimits
from workers.protocol import CacheHints, StreamDelta, Usage
from workers.sampling_params import SamplingParams

CONFIG = RouterConfig()


def _grpc(**fields: Any) -> GenerateInput:
    return generate_from_proto(pb.GenerateRequest(prompt=pb.Prompt(text="hi"), **fields), CONFIG)


def test_grpc_controls_are_carried() -> None:
    plain = _grpc()
    assert (plain.session_id, plain.retention_tokens) == (None, None)
    assert not (plain.skip_cache_read or plain.skip_cache_write or plain.explain_cache)
    inp = _grpc(
        retention_s=3600,
        session_id="conv-1",
        skip_cache_read=True,
        skip_cache_write=True,
        explain_cache=True,
        retention_tokens=64,
    )
    assert (inp.retention_s, inp.session_id, inp.retention_tokens) == (3600, "conv-1", 64)
    assert inp.skip_cache_read and inp.skip_cache_write and inp.explain_cache
    assert _grpc(session_id="s" * 256).session_id == "s" * 256


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"session_id": "s" * 257}, "session_id"),
        ({"session_id": "a\nb"}, "session_id"),
        ({"session_id": "tab\there"}, "session_id"),
        ({"retention_tokens": 0}, "retention_tokens"),
        ({"retention_tokens": -3}, "retention_tokens"),
        ({"retention_s": 86401}, "retention_s"),
    ],
)
def test_grpc_bad_controls_name_the_field(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidInput, match=f"^{name} "):
        _grpc(**fields)


def test_the_worker_is_given_hints_only_for_a_request_with_controls() -> None:
    assert cache_hints(_grpc()) == CacheHints()  # the default: not sent at all
    inp = _grpc(retention_s=300, session_id="c", skip_cache_write=True, retention_tokens=32)
    inp = GenerateInput(**{**inp.__dict__, "tenant": "acme"})
    assert cache_hints(inp) == CacheHints(
        retention_s=300,
        retention_tokens=32,
        tenant="acme",
        session_id="c",
        skip_read=False,
        skip_write=True,
    )


def test_usage_reports_retention_on_grpc() -> None:
    usage = Usage(40, 1, {"hbm": 16}, 24, 1.0, None, "w0", cache_write_tokens=16)
    usage = Usage(**{**usage.__dict__, "retained_tokens": 32, "retention_trimmed_tokens": 8})
    out = delta_to_proto("r", StreamDelta(0, (1,), "x", "stop", usage)).usage
    assert (out.retained_tokens, out.retention_trimmed_tokens) == (32, 8)


def _chat(**body: Any) -> GenerateInput:
    messages = [{"role": "user", "content": "hi"}]
    return parse_chat({"messages": messages, **body}, CONFIG, "rid", 2048).inputs[0]


def _completion(**body: Any) -> GenerateInput:
    return parse_completion({"prompt": ["a", "b"], **body}, CONFIG, "rid").inputs[1]


@pytest.mark.parametrize("parse", [_chat, _completion])
def test_openai_extensions_are_carried(parse: Any) -> None:
    inp = parse(
        prompt_cache_retention="24h",
        cache_session_id="conv-7",
        skip_cache_read=True,
        skip_cache_write=False,
        cache_explain=True,
    )
    assert (inp.retention_s, inp.session_id) == (86400, "conv-7")
    assert inp.skip_cache_read and not inp.skip_cache_write and inp.explain_cache
    assert parse(cache_session_id="").session_id is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"cache_session_id": "s" * 257}, "cache_session_id"),
        ({"cache_session_id": "a\x00b"}, "cache_session_id"),
        ({"cache_session_id": 7}, "cache_session_id"),
        ({"skip_cache_read": "yes"}, "skip_cache_read"),
        ({"skip_cache_write": 1}, "skip_cache_write"),
        ({"cache_explain": "true"}, "cache_explain"),
    ],
)
def test_openai_bad_extensions_name_the_field(body: dict[str, Any], param: str) -> None:
    for parse in (_chat, _completion):
        with pytest.raises(InvalidInput) as info:
            parse(**body)
        assert param_of(str(info.value)) == param, str(info.value)


def test_prewarm_bodies() -> None:
    model, inp = parse_prewarm(
        {
            "model": "m",
            "messages": [{"role": "system", "content": "s"}],
            "prompt_cache_retention": "24h",
            "cache_session_id": "c1",
            "prompt_cache_key": "k",
            "cache_salt": "salt",
        }
    )
    assert model == "m" and inp.prompt.messages is not None
    assert (inp.retention_s, inp.session_id, inp.affinity_key) == (86400, "c1", "k")
    assert inp.cache_salt == "salt" and inp.request_id.startswith("prewarm-")
    _, ids = parse_prewarm({"prompt": [1, 2, 3], "retention_s": 600})
    assert ids.prompt == PromptInput(token_ids=(1, 2, 3)) and ids.retention_s == 600
    assert parse_prewarm({"prompt": "x"})[0] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "retention_s": -1}, "retention_s"),
        ({"prompt": "x", "retention_s": 86401}, "retention_s"),
        ({"prompt": "x", "retention_s": "1h"}, "retention_s"),
        ({"prompt": "x", "retention_s": 60, "prompt_cache_retention": "24h"}, "retention_s"),
        ({"prompt": "x", "prompt_cache_retention": "1h"}, "prompt_cache_retention"),
        ({"prompt": "x", "cache_session_id": "s" * 300}, "cache_session_id"),
        ({"prompt": "x", "cache_salt": "s" * 300}, "cache_salt"),
        ({"prompt": "x", "max_tokens": 5}, "max_tokens"),
    ],
)
def test_prewarm_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_prewarm(body)
    assert param_of(str(info.value)) == param, str(info.value)


def test_grpc_prewarm_is_one_greedy_token_past_the_response_cache() -> None:
    inp = prewarm_from_proto(
        pb.PrewarmRequest(
            prompt=pb.Prompt(text="warm me"), retention_s=3600, session_id="c", affinity_key="k"
        )
    )
    assert (inp.retention_s, inp.session_id, inp.affinity_key) == (3600, "c", "k")
    with pytest.raises(InvalidInput, match="^session_id "):
        prewarm_from_proto(pb.PrewarmRequest(prompt=pb.Prompt(text="x"), session_id="\x07"))
    req = prewarm_request(inp)
    assert req.params == SamplingParams(max_tokens=1, temperature=0.0)
    assert not req.use_response_cache and not req.skip_cache_write
    assert (req.retention_s, req.session_id, req.affinity_key) == (3600, "c", "k")


def test_prewarm_cached_tokens_are_those_read_and_written() -> None:
    usage = Usage(40, 1, {"hbm": 16, "dram": 8}, 16, 1.0, None, "w1", cache_write_tokens=8)
    usage = Usage(**{**usage.__dict__, "retained_tokens": 32})
    result = prewarm_result(usage)
    assert (result.prompt_tokens, result.cached_tokens, result.worker_id) == (40, 32, "w1")
    assert (result.retained_tokens, result.retention_trimmed_tokens) == (32, 0)


@pytest.mark.parametrize(
    ("quota", "field"),
    [
        (pb.TenantQuota(tenant="acme", share=0.0), "quota.share"),
        (pb.TenantQuota(tenant="acme", share=1.0, retention_share=1.5), "quota.retention_share"),
        (pb.TenantQuota(tenant="acme", share=1.0, max_retention_s=-1), "quota.max_retention_s"),
        (pb.TenantQuota(tenant="ac/me", share=1.0), "quota.tenant"),
    ],
)
def test_bad_quotas_name_the_field(quota: pb.TenantQuota, field: str) -> None:
    with pytest.raises(InvalidInput, match=f"^{field} "):
        quota_from_proto(pb.SetTenantQuotaRequest(quota=quota))


def test_a_quota_as_asked() -> None:
    msg = pb.SetTenantQuotaRequest(
        quota=pb.TenantQuota(tenant="", share=0.5, max_retention_s=300, retention_share=0.1)
    )
    assert quota_from_proto(msg) == ("", TenantLimits(0.5, 300, 0.1))
    with pytest.raises(InvalidInput, match="^quota must be set"):
        quota_from_proto(pb.SetTenantQuotaRequest())
