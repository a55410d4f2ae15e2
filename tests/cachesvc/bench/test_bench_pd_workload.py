"""`cachesvc bench pd`'s requests, one list for the live bench and the simulator: the bench
sends exactly `pd_workload.phase_requests` at their offsets (to a stand-in inference server on
a real gRPC port: the bench's client is under test, not the router), and `cachesvc simulate
--like-bench-pd` replays the same requests, hashed as the workers hash their tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cachesvc.bench.pd import _phase
from cachesvc.bench.pd_workload import ALONE, WITH_PROMPTS, PDShape, phase_requests
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.sim.like_bench_pd import phase_sim_requests
from cachesvc.sim.trace import BENCH_VOCAB_SIZE
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc


class _Recorder(pb_grpc.InferenceServicer):
    """Records each request with its arrival; answers its tokens at once."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, list[int], int]] = []

    async def Generate(  # noqa: N802 (the gRPC method's name)
        self, request: Any, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        ids = list(request.prompt.token_ids.ids)
        self.seen.append((time.perf_counter(), ids, request.sampling.max_tokens))
        for i in range(request.sampling.max_tokens):
            yield pb.GenerateResponse(token_ids=[i + 3])
        yield pb.GenerateResponse(usage=pb.Usage(prompt_tokens=len(ids), ttft_ms=1.0))


async def _send_phase(shape: PDShape, phase: str) -> tuple[Any, list[tuple[float, list, int]]]:
    import grpc

    recorder = _Recorder()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            began = time.perf_counter()
            result = await _phase(pb_grpc.InferenceStub(channel), shape, "s", phase, 1000)
    finally:
        await server.stop(None)
    return result, [(t - began, ids, n) for t, ids, n in recorder.seen]


def test_the_bench_sends_the_phase_requests_at_their_offsets() -> None:
    shape = PDShape(quick=True)
    result, seen = asyncio.run(_send_phase(shape, WITH_PROMPTS))
    expected = phase_requests(shape, WITH_PROMPTS, 1000)
    by_prompt = {tuple(ids): (t, n) for t, ids, n in seen}
    assert len(seen) == len(expected) == shape.streams + shape.long_prompts
    for request in expected:
        sent_s, max_tokens = by_prompt[request.prompt_ids]
        assert max_tokens == request.max_tokens
        assert sent_s == pytest.approx(request.offset_s, abs=0.5), "sent at its offset"
    assert len(result.ttft_s) == shape.long_prompts
    assert len(result.gaps_s) == shape.streams * (shape.decode_tokens - 1)


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("phase", [ALONE, WITH_PROMPTS])
def test_the_simulator_replays_the_same_requests(quick: bool, phase: str) -> None:
    shape = PDShape(quick)
    live = phase_requests(shape, phase, BENCH_VOCAB_SIZE)
    simulated = phase_sim_requests(shape, phase)
    root = root_hash("simulated", 16)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in simulated] == [
        (r.offset_s, len(r.prompt_ids), r.max_tokens) for r in live
    ]
    assert [r.hashes for r in simulated] == [
        tuple(hash_blocks(list(r.prompt_ids), 16, root)) for r in live
    ]
    longs = [r for r in live if r.long]
    assert len(longs) == (shape.long_prompts if phase == WITH_PROMPTS else 0)
    assert all(len(r.prompt_ids) == shape.long_tokens for r in longs)
    assert phase_requests(shape, phase, BENCH_VOCAB_SIZE) == live, "deterministic"
    blocks = {h for r in simulated for h in r.hashes}
    assert len(blocks) == sum(len(r.hashes) for r in simulated), "no block shared"
