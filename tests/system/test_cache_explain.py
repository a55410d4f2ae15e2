"""Explained cache hits and misses over real Ray workers and a real gRPC router: a first request
computes every block and says it was never cached, a repeat reads its full blocks from the device,
a flush makes them "evicted", and another tenant's salt never sees them; the OpenAI door answers
the same, asked by header or body field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from http_support import MODEL_NAME, call, error_of, start_http, stop_http
from suite_support import wait_for

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system

BLOCK = 4  # the suite's engine_config block size


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(policy="prefix_aware")


def _explain(server: Any, ids: list[int], salt: str | None = None) -> pb.Usage:
    """The usage of an explained, greedy two-token answer to `ids` (never the response cache)."""
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
        explain_cache=True,
    )
    if salt is not None:
        request.cache_salt = salt
    usage = list(stub.Generate(request, timeout=60))[-1].usage
    segments = usage.explanation.segments
    assert {s.worker_id for s in segments} == {usage.worker_id}
    assert [s.start_token for s in segments[1:]] == [s.end_token for s in segments[:-1]]
    assert (segments[0].start_token, segments[-1].end_token) == (0, len(ids))
    return usage


def _rows(usage: pb.Usage) -> list[tuple[int, int, str, str]]:
    return [
        (s.start_token, s.end_token, s.source, s.miss_reason) for s in usage.explanation.segments
    ]


@pytest.mark.parametrize("prompt_len", [22, 24])  # a partial last block, an exact multiple
def test_first_repeat_flushed_and_another_tenant(server: Any, prompt_len: int) -> None:
    ids = [prompt_len + i for i in range(prompt_len)]  # a first block of its own
    full = (prompt_len - 1) // BLOCK * BLOCK  # tokens before the last token's block

    first = _explain(server, ids)
    assert _rows(first) == [
        (0, full, "computed", "never_cached"),
        (full, prompt_len, "computed", "last_block"),
    ]

    repeat = _explain(server, ids)
    assert repeat.worker_id == first.worker_id
    assert _rows(repeat) == [(0, full, "hbm", ""), (full, prompt_len, "computed", "last_block")]
    assert dict(repeat.cached_tokens) == {"hbm": full}

    # The same tokens under another salt are other blocks: nothing of the first ones shows.
    other = _explain(server, ids, salt="another-tenant")
    assert _rows(other) == _rows(first)

    # A flush drops the device's cached blocks (its events reach the index before it answers).
    pb_grpc.AdminStub(server.channel()).Flush(pb.FlushRequest())
    flushed = _explain(server, ids)
    assert _rows(flushed) == [
        (0, full, "computed", "evicted"),
        (full, prompt_len, "computed", "last_block"),
    ]


def test_not_asked_no_explanation(server: Any) -> None:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=list(range(200, 213)))),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
    )
    usage = list(stub.Generate(request, timeout=60))[-1].usage
    assert not usage.HasField("explanation")


def test_openai_door_by_header_and_by_body(server: Any) -> None:
    http = start_http(server)
    try:
        ids = list(range(100, 114))  # three full blocks, two tokens past them
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "no_response_cache": True}
        status, _, raw = call(http, "POST", "/v1/completions", body, {"x-cache-explain": "1"})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["cache_explanation"] == [
            {
                "start_token": 0,
                "end_token": 12,
                "source": "computed",
                "miss_reason": "never_cached",
            },
            {"start_token": 12, "end_token": 14, "source": "computed", "miss_reason": "last_block"},
        ]
        status, _, raw = call(http, "POST", "/v1/completions", {**body, "cache_explain": True})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["cache_explanation"][0] == {
            "start_token": 0,
            "end_token": 12,
            "source": "hbm",
            "miss_reason": "",
        }
        status, _, raw = call(http, "POST", "/v1/completions", body)
        assert status == 200 and "cache_explanation" not in json.loads(raw)["usage"]
        status, _, raw = call(http, "POST", "/v1/completions", body, {"x-cache-explain": "yes"})
        assert status == 400 and "x-cache-explain" in error_of(raw)["message"]
    finally:
        stop_http(server, http)


def test_an_explained_answer_is_stored_plain_in_the_response_cache(make_server: Any) -> None:
    """The explanation belongs to the request that asked it: the response cache stores the
    answer without it, and answers the same request later from the store."""
    cached = make_server(policy="prefix_aware", response_cache_mb=16)
    stub = pb_grpc.InferenceStub(cached.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=list(range(230, 241)))),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        explain_cache=True,
    )
    first = list(stub.Generate(request, timeout=60))
    assert first[-1].usage.explanation.segments and not first[-1].usage.from_response_cache
    stats = cached.router.responses.stats
    wait_for(lambda: stats.stores >= 1, 60, "the answer to be stored")
    again = list(stub.Generate(request, timeout=60))
    assert again[-1].usage.from_response_cache and stats.rejected == 0
    assert [t for m in again for t in m.token_ids] == [t for m in first for t in m.token_ids]
