"""Explicit cache control through real gRPC and HTTP doors over real Ray workers: a prewarmed
prompt is a hit for the next request, a closed session answers what it released, a tenant's
quota set by the operator shows in the usage and bounds its retention, skipping the cache skips
the response cache too, and bad values are refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from cli_support import cli_lines
from http_support import MODEL_NAME, call, error_of, start_http, stop_http

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.domain import ChatMessage, PromptInput
from router.tenants import TenantLimits, TenantToken

pytestmark = pytest.mark.system
BLOCK = 4  # the session's engine_config block size
OPERATOR = "operator-tok"
TENANTS = (
    TenantToken("acme", "acme-tok", TenantLimits(max_retention_s=600)),
    TenantToken("umbrella", "umbrella-tok"),
)


def _as(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _ids(first: int, num_blocks: int) -> list[int]:
    """A prompt of `num_blocks` full blocks and two tokens more, starting with `first` (each
    test its own: no block of one prompt is another's)."""
    return [first] + [10 + (first + 13 * i) % 300 for i in range(1, num_blocks * BLOCK + 2)]


def _prompt(ids: list[int]) -> pb.Prompt:
    return pb.Prompt(token_ids=pb.TokenIds(ids=ids))


def _generate(
    stub: pb_grpc.InferenceStub, ids: list[int], metadata: Any = None, **fields: Any
) -> pb.Usage:
    request = pb.GenerateRequest(
        prompt=_prompt(ids), sampling=pb.SamplingParams(max_tokens=2, temperature=0.0), **fields
    )
    usage = None
    for reply in stub.Generate(request, metadata=metadata, timeout=120):
        if reply.HasField("usage"):
            usage = reply.usage
    assert usage is not None
    return usage


def _refused(call_: Any, field: str, code: Any = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call_()
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


# ---- without tenants' quotas (the workers need no new call to start) ------------------------


def test_a_prewarmed_prompt_is_a_hit_on_the_worker_that_warmed_it(make_server: Any) -> None:
    server = make_server(policy="prefix_aware")
    cache, stub = pb_grpc.CacheStub(server.channel()), pb_grpc.InferenceStub(server.channel())
    ids = _ids(101, 12)
    warm = cache.Prewarm(pb.PrewarmRequest(prompt=_prompt(ids)), timeout=120)
    assert warm.prompt_tokens == len(ids)
    assert warm.cached_tokens == 12 * BLOCK  # every full block, computed now and written
    usage = _generate(stub, ids)
    assert usage.worker_id == warm.worker_id  # prefix routing found the warmed worker
    assert sum(usage.cached_tokens.values()) == 12 * BLOCK and usage.cache_write_tokens == 0
    again = cache.Prewarm(pb.PrewarmRequest(prompt=_prompt(ids)), timeout=120)
    assert (again.cached_tokens, again.worker_id) == (12 * BLOCK, warm.worker_id)


def test_http_prewarm_then_the_chat_is_a_hit(make_server: Any) -> None:
    server = make_server(policy="prefix_aware")
    http = start_http(server)
    try:
        messages = [{"role": "system", "content": "The quick brown fox jumps over the lazy dog."}]
        messages.append({"role": "user", "content": "hello world, hello router, hello worker"})
        status, _, body = call(
            http, "POST", "/v1/cache/prewarm", {"model": MODEL_NAME, "messages": messages}
        )
        assert status == 200, body
        warm = json.loads(body)
        assert set(warm) == {
            "prompt_tokens",
            "cached_tokens",
            "worker_id",
            "retained_tokens",
            "retention_trimmed_tokens",
        }
        assert warm["cached_tokens"] == warm["prompt_tokens"] // BLOCK * BLOCK > 0
        chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
        status, _, body = call(http, "POST", "/v1/chat/completions", chat)
        assert status == 200, body
        usage = json.loads(body)["usage"]
        assert usage["prompt_tokens"] == warm["prompt_tokens"]
        details = usage["prompt_tokens_details"]
        assert details["cached_tokens"] == warm["cached_tokens"]
        assert (details["retained_tokens"], details["retention_trimmed_tokens"]) == (0, 0)
    finally:
        stop_http(server, http)


def test_bad_values_are_refused_naming_the_field(make_server: Any) -> None:
    server = make_server()
    stub, cache = pb_grpc.InferenceStub(server.channel()), pb_grpc.CacheStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    ids = _ids(102, 2)
    _refused(lambda: _generate(stub, ids, session_id="s" * 257), "session_id")
    _refused(lambda: _generate(stub, ids, session_id="a\x00b"), "session_id")
    _refused(lambda: _generate(stub, ids, retention_tokens=0), "retention_tokens")
    _refused(lambda: _generate(stub, ids, retention_s=86401), "retention_s")
    bad_session = pb.PrewarmRequest(prompt=_prompt(ids), session_id="\x07")
    _refused(lambda: cache.Prewarm(bad_session, timeout=60), "session_id")
    _refused(lambda: cache.CloseSession(pb.CloseSessionRequest(), timeout=60), "session_id")
    quota = pb.TenantQuota(tenant="acme", share=2.0, max_retention_s=60, retention_share=0.5)
    set_quota = pb.SetTenantQuotaRequest(quota=quota)
    _refused(lambda: admin.SetTenantQuota(set_quota, timeout=60), "quota.share")
    http = start_http(server)
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        prewarm = {"prompt": "x"}
        for method, path, body, param in [
            (
                "POST",
                "/v1/chat/completions",
                {**chat, "cache_session_id": "s" * 300},
                "cache_session_id",
            ),
            (
                "POST",
                "/v1/completions",
                {"prompt": "hi", "skip_cache_read": "yes"},
                "skip_cache_read",
            ),
            ("POST", "/v1/cache/prewarm", {**prewarm, "retention_s": -1}, "retention_s"),
            ("POST", "/v1/cache/prewarm", {**prewarm, "cache_session_id": 5}, "cache_session_id"),
            ("DELETE", "/v1/cache/sessions/a%01b", None, "session_id"),
        ]:
            status, _, reply = call(http, method, path, body)
            assert status == 400, (path, reply)
            assert error_of(reply)["param"] == param, reply
    finally:
        stop_http(server, http)


def test_cli_prewarm(make_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    server = make_server(policy="prefix_aware")
    text = "A shared system prompt is cached once and reused by every request of its group."
    (line,) = cli_lines(capsys, ["cache", "prewarm", "--addr", server.address, "--prompt", text])
    warm = json.loads(line)
    assert warm["cached_tokens"] == warm["prompt_tokens"] // BLOCK * BLOCK > 0
    assert warm["worker_id"].startswith("worker-")


# ---- with the workers' cache control calls (close_session, set_quotas, tenant_usage) -------


@pytest.fixture(scope="module")
def tenants_server(make_server: Any) -> Any:
    """A router with an operator, and tenants whose quotas the workers are given at start."""
    return make_server(policy="prefix_aware", auth_token=OPERATOR, tenant_tokens=TENANTS)


def test_a_retained_session_is_released_by_its_tenant_only(tenants_server: Any) -> None:
    cache = pb_grpc.CacheStub(tenants_server.channel())
    ids = _ids(103, 10)
    warm = cache.Prewarm(
        pb.PrewarmRequest(prompt=_prompt(ids), retention_s=300, session_id="conv-1"),
        metadata=_as("acme-tok"),
        timeout=120,
    )
    assert warm.cached_tokens == warm.retained_tokens == 10 * BLOCK
    assert warm.retention_trimmed_tokens == 0
    close = pb.CloseSessionRequest(session_id="conv-1")
    # Another tenant's session of the same id is another session: nothing of acme's goes.
    other = cache.CloseSession(close, metadata=_as("umbrella-tok"), timeout=60)
    assert other.num_blocks_released == 0
    mine = cache.CloseSession(close, metadata=_as("acme-tok"), timeout=60)
    assert mine.num_blocks_released == 10
    again = cache.CloseSession(close, metadata=_as("acme-tok"), timeout=60)
    assert again.num_blocks_released == 0  # closed already


def test_a_retention_past_the_tenants_limit_is_refused(tenants_server: Any) -> None:
    stub = pb_grpc.InferenceStub(tenants_server.channel())
    cache = pb_grpc.CacheStub(tenants_server.channel())
    ids = _ids(104, 2)
    usage = _generate(stub, ids, _as("acme-tok"), retention_s=600)
    assert usage.retained_tokens == 2 * BLOCK
    _refused(lambda: _generate(stub, ids, _as("acme-tok"), retention_s=601), "retention_s")
    long = pb.PrewarmRequest(prompt=_prompt(ids), retention_s=3600)
    _refused(lambda: cache.Prewarm(long, metadata=_as("acme-tok"), timeout=60), "retention_s")
    # umbrella has no limits of its own: a day is allowed
    assert _generate(stub, ids, _as("umbrella-tok"), retention_s=86400).retained_tokens > 0


def test_a_quota_set_by_the_operator_shows_in_the_usage(tenants_server: Any) -> None:
    admin = pb_grpc.AdminStub(tenants_server.channel())
    stub = pb_grpc.InferenceStub(tenants_server.channel())
    quota = pb.TenantQuota(tenant="umbrella", share=0.5, max_retention_s=300, retention_share=0.2)
    request = pb.SetTenantQuotaRequest(quota=quota)
    _refused(
        lambda: admin.SetTenantQuota(request, metadata=_as("umbrella-tok"), timeout=60),
        "the Admin service",
        grpc.StatusCode.PERMISSION_DENIED,
    )
    reply = admin.SetTenantQuota(request, metadata=_as(OPERATOR), timeout=60)
    assert reply.quota == quota
    ids = _ids(105, 6)
    assert _generate(stub, ids, _as("umbrella-tok"), retention_s=300).retained_tokens == 24
    _refused(lambda: _generate(stub, ids, _as("umbrella-tok"), retention_s=301), "retention_s")
    usage = admin.TenantUsage(pb.TenantUsageRequest(), metadata=_as(OPERATOR), timeout=60)
    by_tenant = {entry.quota.tenant: entry for entry in usage.tenants}
    assert by_tenant["umbrella"].quota == quota
    assert by_tenant["acme"].quota.max_retention_s == 600  # the tokens file's
    hbm = by_tenant["umbrella"].tiers["hbm"]
    assert hbm.cached >= 6 and hbm.retained >= 6


def test_skipping_the_cache_skips_the_response_cache(make_server: Any) -> None:
    server = make_server(policy="prefix_aware", response_cache_mb=8)
    stub = pb_grpc.InferenceStub(server.channel())
    ids = _ids(106, 4)
    first = _generate(stub, ids)
    assert not first.from_response_cache
    assert _generate(stub, ids).from_response_cache
    unread = _generate(stub, ids, skip_cache_read=True)
    assert not unread.from_response_cache
    assert sum(unread.cached_tokens.values()) == 0  # nor any cached KV
    fresh = _ids(107, 4)
    _generate(stub, fresh, skip_cache_write=True)
    after = _generate(stub, fresh)
    assert not after.from_response_cache  # the answer was not stored
    assert sum(after.cached_tokens.values()) == 0  # nor its KV


def test_cli_close_session_quota_and_usage(
    tenants_server: Any, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    token = tmp_path / "operator"
    token.write_text(OPERATOR)
    base = ["--addr", tenants_server.address, "--auth-token-file", str(token)]
    (line,) = cli_lines(
        capsys,
        ["cache", "quota", *base, "--tenant", "acme", "--share", "0.25", "--max-retention", "5m"],
    )
    assert json.loads(line) == {
        "tenant": "acme",
        "share": 0.25,
        "max_retention_s": 300,
        "retention_share": 0.5,
    }
    (line,) = cli_lines(capsys, ["cache", "usage", *base])
    tenants = {t["quota"]["tenant"]: t for t in json.loads(line)["tenants"]}
    assert tenants["acme"]["quota"]["share"] == 0.25
    (line,) = cli_lines(capsys, ["cache", "close-session", *base, "nobody's"])
    assert json.loads(line) == {"session_id": "nobody's", "num_blocks_released": 0}


def test_an_anthropic_breakpoint_retains_the_prompt_up_to_it(make_server: Any) -> None:
    server = make_server(policy="prefix_aware")
    http = start_http(server)
    system = "The quick brown fox jumps over the lazy dog. " * 3
    control = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "model": MODEL_NAME,
        "max_tokens": 2,
        "temperature": 0,
        "system": [{"type": "text", "text": system, "cache_control": control}],
        "messages": [{"role": "user", "content": "hello world, hello router " * 4}],
    }
    registry = server.router.metrics.registry

    def retained() -> float:
        sample = {"outcome": "retained"}
        return registry.get_sample_value("cachesvc_retained_tokens_total", sample) or 0.0

    try:
        before = retained()
        status, _, reply = call(http, "POST", "/v1/messages", body)
        assert status == 200, reply
        prefix = PromptInput(messages=(ChatMessage("system", system),), add_generation_prompt=False)
        num_prefix = len(server.run(server.router.prompts.encode(prefix)))
        usage = json.loads(reply)["usage"]  # read + written + the rest: the prompt
        parts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        prompt_tokens = sum(usage[part] for part in parts)
        # Only the system part (its full blocks) is retained, not the question after it.
        assert num_prefix // BLOCK * BLOCK < prompt_tokens // BLOCK * BLOCK
        assert retained() - before == num_prefix // BLOCK * BLOCK
    finally:
        stop_http(server, http)
