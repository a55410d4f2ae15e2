"""Prefill/decode disaggregation through the router: a prefill worker computes the prompt and
its first token, a decode worker pulls the prompt's KV from it and decodes the rest. The client
sees one stream with the tokens and text of colocated serving (greedy, seeded, n samples),
usage names the prefill worker and the KV moved; beam search stays colocated; a dead prefill
worker costs a recompute on the decode side, never an error."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pd_support import spawn_pulling
from worker_support import pid_of

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system

BLOCK = 4
PROMPT_TOKENS = 42  # 10 full blocks and 2 tokens
GREEDY = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = pb.SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=7, ignore_eos=True)
PREFILL, DECODE = WorkerId("prefill-0"), WorkerId("decode-0")


@pytest.fixture(scope="module")
def roles(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    """One prefill and one decode worker, pulls on and forced (`pd_support.spawn_pulling`)."""
    import ray

    actors = spawn_pulling(engine_config, {PREFILL: "prefill", DECODE: "decode"})
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _prompt(seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 3 for j in range(PROMPT_TOKENS)]


def _generate(
    server: Any, ids: list[int], sampling: pb.SamplingParams
) -> list[pb.GenerateResponse]:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), sampling=sampling
    )
    return list(stub.Generate(request, timeout=120))


def _flush(server: Any) -> None:
    pb_grpc.AdminStub(server.channel()).Flush(pb.FlushRequest(), timeout=60)


def _answer(messages: list[pb.GenerateResponse]) -> tuple[list[int], str, pb.Usage]:
    tokens = [t for m in messages for t in m.token_ids]
    text = "".join(m.text for m in messages)
    last = messages[-1]
    assert last.finish_reason == "length" and last.HasField("usage")
    return tokens, text, last.usage


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handed_off_stream_equals_colocated(
    start_router: Any, roles: dict[WorkerId, Any], sampling: pb.SamplingParams
) -> None:
    import ray

    ids = _prompt(int(sampling.seed) + 1)
    colocated = start_router(roles, pd_mode="never")
    expected, expected_text, alone = _answer(_generate(colocated, ids, sampling))
    assert alone.worker_id == DECODE and not alone.prefill_worker_id  # roles are honoured
    listed = pb_grpc.AdminStub(colocated.channel()).ListWorkers(pb.ListWorkersRequest())
    assert {w.worker_id: w.role for w in listed.workers} == {PREFILL: "prefill", DECODE: "decode"}
    _flush(colocated)

    server = start_router(roles, pd_mode="always")
    messages = _generate(server, ids, sampling)
    tokens, text, usage = _answer(messages)
    assert tokens == expected and text == expected_text
    # The first token came from the prefill worker alone, as its own message.
    assert len(messages[0].token_ids) == 1
    assert usage.prefill_worker_id == PREFILL and usage.worker_id == DECODE
    full = PROMPT_TOKENS // BLOCK * BLOCK
    assert usage.kv_transfer_tokens == full  # every full block of the prompt was pulled
    assert usage.prompt_tokens == PROMPT_TOKENS and usage.completion_tokens == len(expected)
    assert usage.computed_tokens == PROMPT_TOKENS + (PROMPT_TOKENS - full + 1)
    metrics = server.router.metrics.registry
    assert metrics.get_sample_value("cachesvc_pd_decisions_total", {"mode": "disaggregated"}) == 1
    # The prefill worker held the prompt's blocks for the pull and served it from those pins.
    sent = ray.get(roles[PREFILL].stats.remote(), timeout=60).tiering
    assert sent["peer_held_chunks"] >= 1
    _flush(server)


def test_one_token_request_is_served_by_the_prefill_worker(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    import ray

    server = start_router(roles, pd_mode="always")
    sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    held = ray.get(roles[PREFILL].stats.remote(), timeout=60).tiering["peer_held_requests"]
    tokens, _, usage = _answer(_generate(server, _prompt(50), sampling))
    assert len(tokens) == 1 and usage.worker_id == PREFILL and usage.kv_transfer_tokens == 0
    # No pull follows: the prefill worker was not asked to keep the prompt's blocks pinned.
    after = ray.get(roles[PREFILL].stats.remote(), timeout=60).tiering["peer_held_requests"]
    assert after == held
    _flush(server)


def test_several_samples_are_handed_off_one_by_one(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    """Each sample's first token comes from the prefill worker; each continues on the decode
    worker as its own request (seed + i), as after a failover: the samples are colocated's."""
    ids = _prompt(60)
    sampling = pb.SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True)
    reference = start_router(roles, pd_mode="never")
    expected = _samples(_generate(reference, ids, sampling))
    _flush(reference)
    server = start_router(roles, pd_mode="always")
    messages = _generate(server, ids, sampling)
    assert _samples(messages) == expected
    usages = [m.usage for m in messages if m.HasField("usage")]
    assert len(usages) == 2
    assert all(u.worker_id == DECODE and u.prefill_worker_id == PREFILL for u in usages), usages
    _flush(server)


def test_beam_search_stays_colocated(start_router: Any, roles: dict[WorkerId, Any]) -> None:
    server = start_router(roles, pd_mode="always")
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, beam_width=2, ignore_eos=True)
    messages = _generate(server, _prompt(65), sampling)
    usages = [m.usage for m in messages if m.HasField("usage")]
    assert usages and all(u.worker_id == DECODE and not u.prefill_worker_id for u in usages)
    _flush(server)


def _samples(messages: list[pb.GenerateResponse]) -> dict[int, tuple[list[int], str]]:
    out: dict[int, tuple[list[int], str]] = {}
    for m in messages:
        tokens, text = out.get(m.index, ([], ""))
        out[m.index] = (tokens + list(m.token_ids), text + m.text)
    return out


def test_auto_decides_per_request_and_says_why(
    start_router: Any, roles: dict[WorkerId, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Whichever way `auto` goes, the answer is the colocated one and the decision is
    counted and logged with its reason; the tiny model's prefill is so cheap that an idle
    decode worker keeps it."""
    server = start_router(roles, pd_mode="auto")
    with caplog.at_level(logging.INFO, logger="router.requests"):
        tokens, _, usage = _answer(_generate(server, _prompt(70), GREEDY))
    logged = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert len(logged) == 1
    fields = vars(logged[0])
    mode, reason = fields["pd_mode"], fields["pd_reason"]
    assert mode in ("colocated", "disaggregated") and reason.startswith(mode)
    assert len(tokens) == GREEDY.max_tokens
    metrics = server.router.metrics.registry
    counted = sum(
        metrics.get_sample_value("cachesvc_pd_decisions_total", {"mode": mode}) or 0
        for mode in ("colocated", "disaggregated")
    )
    assert counted == 1
    assert usage.worker_id == DECODE  # never the prefill worker for a whole request
    _flush(server)


def test_frozen_prefill_worker_costs_a_recompute(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    """A prefill worker that stops answering (SIGSTOP) before its token: the request waiting
    on it is served colocated on the decode worker, with the same tokens."""
    import os
    import signal

    ids = _prompt(90)
    reference = start_router(roles, pd_mode="never")
    expected, _, _ = _answer(_generate(reference, ids, GREEDY))
    _flush(reference)
    server = start_router(
        roles, pd_mode="always", ping_timeout_s=0.3, stall_check_s=0.1, max_missed_polls=2
    )
    pid = pid_of(roles[PREFILL])
    os.kill(pid, signal.SIGSTOP)
    try:
        tokens, _, usage = _answer(_generate(server, ids, GREEDY))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert tokens == expected
    assert usage.worker_id == DECODE and not usage.prefill_worker_id
    assert usage.computed_tokens == PROMPT_TOKENS
    _flush(server)


def test_decode_worker_counts_the_request_while_its_prefill_runs(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    """Paired at planning: while the prefill worker holds the request (frozen here, not long
    enough to be declared unhealthy), the decode worker already counts it, so requests arriving
    meanwhile see it; the count goes when the request ends."""
    import os
    import signal
    import threading

    server = start_router(roles, pd_mode="always")
    admin = pb_grpc.AdminStub(server.channel())

    def inflight() -> dict[str, int]:
        listed = admin.ListWorkers(pb.ListWorkersRequest()).workers
        return {w.worker_id: w.num_inflight for w in listed}

    pid = pid_of(roles[PREFILL])
    answers: list[Any] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        call = threading.Thread(
            target=lambda: answers.append(_answer(_generate(server, _prompt(95), GREEDY)))
        )
        call.start()
        deadline = time.monotonic() + 3
        while inflight() != {PREFILL: 1, DECODE: 1} and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = inflight()
    finally:
        os.kill(pid, signal.SIGCONT)
    call.join(timeout=120)
    assert seen == {PREFILL: 1, DECODE: 1}
    assert answers and answers[0][2].prefill_worker_id == PREFILL
    assert inflight() == {PREFILL: 0, DECODE: 0}
    _flush(server)


def test_dead_prefill_worker_costs_a_recompute(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    """Last in this module: it kills the prefill worker."""
    import ray

    ids = _prompt(80)
    reference = start_router(roles, pd_mode="never")
    expected, _, _ = _answer(_generate(reference, ids, GREEDY))
    _flush(reference)
    server = start_router(roles, pd_mode="always")
    ray.kill(roles[PREFILL], no_restart=True)
    tokens, _, usage = _answer(_generate(server, ids, GREEDY))
    assert tokens == expected
    assert usage.worker_id == DECODE and usage.kv_transfer_tokens == 0
    assert usage.computed_tokens == PROMPT_TOKENS
