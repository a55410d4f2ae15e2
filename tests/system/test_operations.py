"""Operating the router: full queues and admission answer RESOURCE_EXHAUSTED, the Prometheus
endpoint and the JSON request log move with requests, and with many hot groups prefix_aware
stays balanced."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from http_support import MODEL_NAME, base_url, start_http, stop_http
from pd_support import slow_steps
from prometheus_client.parser import text_string_to_metric_families

from cachesvc.bench.routing import run_policy
from cachesvc.workloads.routing import Variant
from cachesvc.workloads.sessions import groups_workload
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.logs import JsonFormatter

pytestmark = pytest.mark.system
VOCAB = 320  # the session's tiny model


def _request(ids: list[int], max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _wait_idle(admin: pb_grpc.AdminStub) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
        if all(w.num_inflight == 0 and w.num_running + w.num_waiting == 0 for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError("the workers did not go idle")


def _exhausted(stub: pb_grpc.InferenceStub, message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request([3, 4, 5], 2), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message in err.value.details()


def test_full_worker_queues_are_resource_exhausted(make_server: Any) -> None:
    server = make_server(max_queued_per_worker=1)
    stub, admin = pb_grpc.InferenceStub(server.channel()), pb_grpc.AdminStub(server.channel())
    streams = [stub.Generate(_request([9, 8, 7, s], 480), timeout=60) for s in (1, 2)]
    for stream in streams:
        next(stream)  # running: each worker now holds one request
    _exhausted(stub, "every worker's queue is full (1 requests each)")
    for stream in streams:
        stream.cancel()
    _wait_idle(admin)
    assert list(stub.Generate(_request([3, 4, 5], 2), timeout=30))[-1].finish_reason == "length"


def test_router_limit_is_resource_exhausted(make_server: Any) -> None:
    server = make_server(max_inflight=1)
    stub = pb_grpc.InferenceStub(server.channel())
    stream = stub.Generate(_request([9, 8, 7, 6], 480), timeout=60)
    next(stream)
    _exhausted(stub, "router is at its limit of 1 requests")
    stream.cancel()
    _wait_idle(pb_grpc.AdminStub(server.channel()))


def _in_flight(server: Any, worker: Any) -> None:
    """Until the router has a request on `worker` whose first token has not come."""
    deadline = time.monotonic() + 30
    while server.router.pool.state(worker).num_inflight_tokens == 0:
        assert time.monotonic() < deadline, "the first request never reached the worker"
        time.sleep(0.02)


def test_admission_refuses_a_request_that_would_wait_behind_others(
    start_router: Any, worker_pair: dict[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.requests")
    # One worker whose steps take 1.5 s more; any prompt takes longer than a microsecond.
    worker, actor = next(iter(worker_pair.items()))
    server = start_router({worker: actor}, admit_ttft_ms=0.001)
    stub = pb_grpc.InferenceStub(server.channel())
    http = start_http(server)
    slow_steps(actor, 2.5)
    try:
        ahead = stub.Generate(_request([9, 8, 7, 6, 5], 2), timeout=60)
        _in_flight(server, worker)
        for _ in range(2):  # refused behind it, and the router goes on answering
            _exhausted(stub, "exceeds admit_ttft_ms")
        client = openai.OpenAI(base_url=base_url(http), api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:  # the HTTP door: 429
            client.completions.create(model=MODEL_NAME, prompt=[3, 4, 5], max_tokens=2)
        assert "admit_ttft_ms" in err.value.message
        assert list(ahead)[-1].finish_reason == "length", "the request ahead is served"
    finally:
        slow_steps(actor, 0)
        stop_http(server, http)
    assert server.router.metrics.refused._value.get() == 3
    # Nothing queued ahead: admitted whatever its prediction (refusing it protects no queue).
    reply = list(stub.Generate(_request([3, 4, 5], 2, "admitted"), timeout=60))
    assert reply[-1].finish_reason == "length"
    scale = server.router.admission.admission.scale
    assert scale.predicted_s > 0 and scale.measured_s > 0, "admitted requests are learnt"
    # The request log has each decision's prediction, beside the TTFT measured when served.
    finished = [r for r in caplog.records if r.getMessage() == "request finished"]
    logged = [json.loads(JsonFormatter().format(r)) for r in finished]
    refused = [line for line in logged if line["status"] == "exhausted"]
    assert len(refused) == 3
    assert all("exceeds admit_ttft_ms" in line["route_reason"] for line in refused)
    assert all(line["admit_predicted_ttft_ms"] > 0.001 for line in refused)
    (admitted,) = [line for line in logged if line["request_id"] == "admitted"]
    assert admitted["admit_predicted_ttft_ms"] > 0 and admitted["ttft_ms"] > 0


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


_REQUESTS = "cachesvc_requests_total"


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_endpoint_and_request_log(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.requests")
    server = make_server(metrics_port=0)
    port = server.server.metrics.port
    stub = pb_grpc.InferenceStub(server.channel())
    prefix = list(range(40, 64))
    for i in range(2):
        list(stub.Generate(_request(prefix + [i], 3, f"metrics-{i}"), timeout=60))
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(_request([], 3), timeout=30))

    m = _scrape(port)
    assert _value(m, _REQUESTS, door="grpc", method="Generate", status="OK") == 2
    assert _value(m, _REQUESTS, door="grpc", method="Generate", status="INVALID_ARGUMENT") == 1
    assert _value(m, "cachesvc_ttft_seconds_count") == 2
    assert _value(m, "cachesvc_request_latency_seconds_count") == 2
    assert _value(m, "cachesvc_prompt_tokens_total") == 2 * 25
    assert _value(m, "cachesvc_cached_tokens_total", tier="hbm") >= 24
    assert 0.4 < _value(m, "cachesvc_cache_hit_ratio", tier="hbm") < 0.6
    decisions = [v for (name, _), v in m.items() if name == "cachesvc_routing_decisions_total"]
    assert sum(decisions) == 2
    for worker in ("worker-0", "worker-1"):
        assert _value(m, "cachesvc_worker_up", worker=worker) == 1
        assert _value(m, "cachesvc_worker_blocks", worker=worker, tier="hbm", state="total") == 256
        assert ("cachesvc_worker_queue_depth", (("worker", worker),)) in m

    lines = [r for r in caplog.records if getattr(r, "request_id", "") == "metrics-1"]
    assert len(lines) == 1
    logged = json.loads(JsonFormatter().format(lines[0]))
    assert logged["message"] == "request finished" and logged["status"] == "ok"
    assert logged["cached_tokens"] >= 24 and logged["worker"] in ("worker-0", "worker-1")


def test_many_hot_groups_stay_balanced(worker_pair: Any, tiny_model_dir: Path) -> None:
    sessions = groups_workload(
        VOCAB,
        num_groups=16,
        prompts_per_group=4,
        system_len=32,
        question_len=4,
        output_len=4,
        rate=40.0,
        seed=3,
    )

    def run(policy: str) -> Any:
        variant = Variant(policy, policy)
        return asyncio.run(run_policy(worker_pair, str(tiny_model_dir), variant, sessions))

    result = run("prefix_aware")
    assert result.num_errors == 0 and result.num_requests == 64
    # The policy evens out busy seconds, not request counts: on a busy machine one worker's
    # slower steps rightly give it fewer requests (a CI run saw 16 / 48). What it guarantees on
    # counts is the traffic bound: no worker past `balance_traffic_factor` (1.5) times the mean,
    # plus the one request that may land on a worker just under it. Everything on one worker
    # (no balance at all) would be 2.0.
    mean = result.num_requests / len(result.requests_per_worker)
    assert max(result.requests_per_worker.values()) <= 1.5 * mean + 1, result.requests_per_worker
    assert min(result.requests_per_worker.values()) > 0, result.requests_per_worker
    # Balanced without giving up the cache: better than spreading requests blindly.
    assert result.hit_ratio > run("round_robin").hit_ratio, result
