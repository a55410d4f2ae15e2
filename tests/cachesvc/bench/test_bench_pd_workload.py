"""`cachesvc bench pd`'s requests, one list for the live bench and the simulator: the bench
sends exactly `pd_workload.phase_requests` at their offsets (to a stand-in inference server on
a real gRPC port: the bench's client is under test, not the router), and `cachesvc simulate
--like-bench-pd` replays the same requests, hashed as the workers hash their tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cachesvc.bench.pd import _phase
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.sim.like_bench_pd import phase_sim_requests
from cachesvc.sim.trace import BENCH_VOCAB_SIZE
from cachesvc.workloads.pd import ALONE, WITH_PROMPTS, PDShape, phase_requests
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc


class _Recorder(pb_grpc.InferenceServicer):
    """Records each request's prompt and answer length; answers its tokens at once."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], int]] = []

    async def Generate(  # noqa: N802 (the gRPC method's name)
        self, request: Any, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        ids = tuple(request.prompt.token_ids.ids)
        self.seen.append((ids, request.sampling.max_tokens))
        for i in range(request.sampling.max_tokens):
            yield pb.GenerateResponse(token_ids=[i + 3])
        yield pb.GenerateResponse(usage=pb.Usage(prompt_tokens=len(ids), ttft_ms=1.0))


class _SendLog:
    """The bench's stub: notes each prompt it sends, in order, with the loop's clock then."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self._stub = stub
        self.sent: list[tuple[float, tuple[int, ...]]] = []

    def Generate(self, request: pb.GenerateRequest) -> Any:  # noqa: N802 (the stub's method)
        now = asyncio.get_running_loop().time()
        self.sent.append((now, tuple(request.prompt.token_ids.ids)))
        return self._stub.Generate(request)


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still while anything is ready to run and otherwise
    jumps to its next timer: a sleep takes no time, and the clock when a request is sent says
    what the bench asked for, whatever the machine's load (gRPC's own I/O is real)."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        # BaseEventLoop's step: it waits in select() until its first timer is due; with the
        # clock moved there first, it does not wait.
        ready, scheduled = self._ready, self._scheduled  # type: ignore[attr-defined]
        if not ready and scheduled:
            self._now = max(self._now, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


async def _send_phase(shape: PDShape, phase: str) -> tuple[Any, _SendLog, _Recorder]:
    import grpc

    recorder = _Recorder()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            log = _SendLog(pb_grpc.InferenceStub(channel))
            began = asyncio.get_running_loop().time()
            result = await _phase(log, shape, "s", phase, 1000)
    finally:
        await server.stop(None)
    log.sent = [(t - began, ids) for t, ids in log.sent]
    return result, log, recorder


def test_the_bench_sends_the_phase_requests_at_their_offsets() -> None:
    shape = PDShape(quick=True)
    loop = _VirtualClockLoop()
    try:
        result, log, recorder = loop.run_until_complete(_send_phase(shape, WITH_PROMPTS))
    finally:
        loop.close()
    expected = phase_requests(shape, WITH_PROMPTS, 1000)
    assert len(expected) == shape.streams + shape.long_prompts
    # In their order, each at its offset: the streams at once, then a prompt every interval.
    assert [ids for _, ids in log.sent] == [r.prompt_ids for r in expected]
    assert [t for t, _ in log.sent] == pytest.approx([r.offset_s for r in expected])
    # Each reached the server once, asking for its answer's length.
    assert sorted(recorder.seen) == sorted((r.prompt_ids, r.max_tokens) for r in expected)
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
