"""Prefill/decode hand-off between two MIXED workers (`pd_mixed`): no worker has a role; the
prompt runs on the worker the policy chose (or on the other, when it holds as much and its
prefill stalls fewer streams there) and the decode on the other, which pulls the prompt's KV
from it. The client's tokens and text are colocated serving's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from pd_support import slow_steps, spawn_pulling
from worker_support import pid_of

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system

BLOCK = 4
PROMPT_TOKENS = 42  # 10 full blocks and 2 tokens
WORKERS = (WorkerId("mixed-0"), WorkerId("mixed-1"))


@pytest.fixture(scope="module")
def mixed(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    """Two mixed workers, pulls on and forced (`pd_support.spawn_pulling`)."""
    import ray

    actors = spawn_pulling(engine_config, dict.fromkeys(WORKERS, "mixed"))
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _answer(server: Any, ids: list[int], sampling: pb.SamplingParams) -> tuple[Any, ...]:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), sampling=sampling
    )
    messages = list(stub.Generate(request, timeout=120))
    last = messages[-1]
    assert last.finish_reason == "length" and last.HasField("usage")
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, "".join(m.text for m in messages), last.usage, messages


def _flush(server: Any) -> None:
    pb_grpc.AdminStub(server.channel()).Flush(pb.FlushRequest(), timeout=60)


@pytest.mark.parametrize(
    "sampling",
    [
        pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        pb.SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_two_mixed_workers_hand_a_request_off(
    start_router: Any, mixed: dict[WorkerId, Any], sampling: pb.SamplingParams
) -> None:
    ids = [(int(sampling.seed) * 31 + 7 * j) % 250 + 3 for j in range(PROMPT_TOKENS)]
    colocated = start_router(mixed, pd_mode="never", pd_mixed=True)
    expected, expected_text, alone, _ = _answer(colocated, ids, sampling)
    assert not alone.prefill_worker_id and alone.kv_transfer_tokens == 0
    _flush(colocated)

    server = start_router(mixed, pd_mode="always", pd_mixed=True)
    tokens, text, usage, messages = _answer(server, ids, sampling)
    assert tokens == expected and text == expected_text
    assert len(messages[0].token_ids) == 1, "the first token came from the prompt's worker"
    # The prompt on one mixed worker, the decode on the other, every full block pulled.
    assert {usage.prefill_worker_id, usage.worker_id} == set(WORKERS)
    full = PROMPT_TOKENS // BLOCK * BLOCK
    assert usage.kv_transfer_tokens == full
    assert usage.computed_tokens == PROMPT_TOKENS + (PROMPT_TOKENS - full + 1)
    metrics = server.router.metrics.registry
    assert metrics.get_sample_value("cachesvc_pd_decisions_total", {"mode": "disaggregated"}) == 1
    _flush(server)


def test_mixed_workers_without_the_switch_serve_colocated(
    start_router: Any, mixed: dict[WorkerId, Any]
) -> None:
    """`pd_mixed` off (the default): "always" has no prefill worker to hand off from."""
    server = start_router(mixed, pd_mode="always")
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _, _, usage, _ = _answer(server, list(range(3, 3 + PROMPT_TOKENS)), sampling)
    assert not usage.prefill_worker_id and usage.kv_transfer_tokens == 0
    _flush(server)


def test_admission_refuses_a_hand_off_before_its_prefill(
    start_router: Any, mixed: dict[WorkerId, Any]
) -> None:
    """With a prompt computing on each worker (steps slowed), a request the plan would hand off
    is refused on its prompt worker's predicted TTFT, before any worker runs it, its P/D
    decision or its prompt's share counted."""
    server = start_router(mixed, pd_mode="always", pd_mixed=True, admit_ttft_ms=0.001)
    stub = pb_grpc.InferenceStub(server.channel())
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def request(seed: int) -> pb.GenerateRequest:
        ids = [(seed * 13 + 7 * j) % 250 + 3 for j in range(PROMPT_TOKENS)]
        return pb.GenerateRequest(
            prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), sampling=sampling
        )

    for actor in mixed.values():
        slow_steps(actor, 1.5)
    try:
        ahead = []
        for seed in (1, 2):  # each admitted with nothing ahead of it, one per worker
            ahead.append(stub.Generate(request(seed), timeout=120))
            deadline = time.monotonic() + 30
            while sum(server.router.pool.state(w).num_inflight_tokens > 0 for w in mixed) < seed:
                assert time.monotonic() < deadline, "a prompt never reached its worker"
                time.sleep(0.02)
        shares = server.router.pd.shares.shares(time.monotonic(), list(mixed))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(3), timeout=120))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "admit_ttft_ms" in err.value.details()
        after = server.router.pd.shares.shares(time.monotonic(), list(mixed))
        assert all(after[w] <= shares[w] for w in mixed), "no prompt share for the refused"
        for stream in ahead:
            assert list(stream)[-1].finish_reason == "length"
    finally:
        for actor in mixed.values():
            slow_steps(actor, 0)
    metrics = server.router.metrics.registry
    assert metrics.get_sample_value("cachesvc_refused_total") == 1
    planned = sum(
        metrics.get_sample_value("cachesvc_pd_decisions_total", {"mode": mode}) or 0
        for mode in ("colocated", "disaggregated")
    )
    assert planned == 2, "the refused request is no decision"
    _flush(server)


def test_a_frozen_prompt_worker_falls_back_on_the_other(
    start_router: Any, mixed: dict[WorkerId, Any]
) -> None:
    """The prompt's worker (the one holding it, so the policy's choice) stops answering
    (SIGSTOP) before its token: the request is served whole on the other mixed worker, with
    the same tokens, in the same attempt (no retry is allowed), not sent back to the frozen
    worker as its colocated placement."""
    import os
    import signal

    ids = [(11 * j) % 250 + 3 for j in range(PROMPT_TOKENS)]
    sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = start_router(mixed, pd_mode="never", pd_mixed=True)
    expected, _, alone, _ = _answer(reference, ids, sampling)
    holder = WorkerId(alone.worker_id)  # it keeps the prompt's blocks
    (other,) = set(WORKERS) - {holder}
    # The default ping timeouts: shorter ones declare the other worker dead too on a busy host.
    server = start_router(mixed, pd_mode="always", pd_mixed=True, max_retries=0)
    actor = mixed[holder]
    pid = pid_of(actor)
    os.kill(pid, signal.SIGSTOP)
    try:
        tokens, _, usage, _ = _answer(server, ids, sampling)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert tokens == expected
    assert usage.worker_id == other and not usage.prefill_worker_id
    _flush(server)


def test_the_prompt_moves_off_a_worker_whose_streams_it_would_stall(
    start_router: Any, mixed: dict[WorkerId, Any]
) -> None:
    """Round robin sends the request to mixed-0, which is decoding four streams; mixed-1
    holds as much of the prompt (nothing) with no more queued and decodes nothing, so the
    prompt is computed there (`pick_prefill`) and the decode goes to mixed-0. Tokens as
    colocated. An attempt counts only if the stream was still decoding when the request
    ended (on a fast machine it may end first)."""
    import threading
    import uuid

    import ray

    busy, idle = WORKERS
    sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for attempt in range(3):
        # A prompt no worker has seen: neither holds any of it.
        ids = [(13 * j + 7 * attempt) % 250 + 3 for j in range(PROMPT_TOKENS)]
        # The stall weighs 50x: the prompt's move must not hang on how fast each worker's
        # calibration says it computes (on a busy host they differ up to 20x).
        server = start_router(
            mixed, pd_mode="always", pd_mixed=True, policy="round_robin", pd_stall_weight=50.0
        )
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "n": 4}
        stream = (
            mixed[busy]
            .generate.options(num_returns="streaming")
            .remote([5, 6, 7, 8, 9], params, uuid.uuid4().hex, None)
        )
        done = threading.Event()

        def drain(refs: Any = stream, ended: threading.Event = done) -> None:
            for ref in refs:
                ray.get(ref)
            ended.set()

        threading.Thread(target=drain, daemon=True).start()
        state = server.router.pool.state(busy)
        seen = False
        for _ in range(200):  # the router sees the stream at its next poll
            seen = state.load.num_running > 0
            if seen or done.is_set():
                break
            done.wait(0.01)
        tokens, _, usage, _ = _answer(server, ids, sampling)
        raced = done.is_set() or not seen
        done.wait(60)
        _flush(server)
        if raced:
            continue
        reference = start_router(mixed, pd_mode="never")
        expected, _, _, _ = _answer(reference, ids, sampling)
        _flush(reference)
        assert tokens == expected
        assert (usage.prefill_worker_id, usage.worker_id) == (idle, busy)
        return
    pytest.fail("the long stream ended before the request three times: lengthen it")
