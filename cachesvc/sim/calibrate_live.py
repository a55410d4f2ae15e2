"""What a live deployment adds to the engine's own step times, measured through a real router and
two real Ray workers on this machine (the second half of `cachesvc simulate calibrate`).

A client sees more than `Engine.step` takes: its request and each token travel through the
router's gRPC door and Ray (`hop_s`); between two steps the worker's event loop streams the
step's outputs and the next step waits for it (`step_overhead_s`); and workers on one host share
its cores with each other and with the router (`contention`). Three measurements, with the
workers idle but for what is sent:

* hop: one-token requests of a short prompt, one at a time: the client's time to first token
  less the worker's own (`Usage.ttft_ms`, from the engine's arrival to the token);
* step overhead: one decoding stream alone: the median gap between its tokens, as the client
  sees them, less the profile's decode step for its context;
* contention: one stream on each worker at once: their median gap over the lone stream's, less
  one (per other worker stepping).

Each is a median over several rounds, alone and together interleaved, so that work elsewhere on
the machine weighs on both alike.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.sim.cost_profile import CostProfile

NUM_WORKERS = 2
HOP_REQUESTS = 12
HOP_PROMPT_LEN = 32
STREAM_PROMPT_LEN = 48
STREAM_TOKENS = 48
ROUNDS = 3


@dataclass(frozen=True)
class LiveTerms:
    """The live path's terms of a profile, with the medians they came from (ms)."""

    hop_s: float
    step_overhead_s: float
    contention: float
    client_ttft_ms: float  # the one-token requests'
    worker_ttft_ms: float
    gap_alone_ms: float
    gap_together_ms: float
    engine_step_ms: float  # the profile's decode step for the lone stream

    def describe(self) -> str:
        return (
            f"hop {self.hop_s * 1e3:.1f} ms (client TTFT {self.client_ttft_ms:.0f} - worker's "
            f"{self.worker_ttft_ms:.0f}), step overhead {self.step_overhead_s * 1e3:.1f} ms (gap "
            f"alone {self.gap_alone_ms:.1f} - engine step {self.engine_step_ms:.1f}), contention "
            f"{self.contention:.2f} (gap with both workers stepping {self.gap_together_ms:.1f})"
        )


def terms_from(
    profile: CostProfile,
    hops_ms: Sequence[tuple[float, float]],
    gaps_alone_ms: Sequence[float],
    gaps_together_ms: Sequence[float],
) -> LiveTerms:
    """The terms from the measurements (pure): `hops_ms` holds (client, worker) TTFTs of the
    one-token requests; the gaps are the streams' client-side inter-token gaps."""
    context = STREAM_PROMPT_LEN + STREAM_TOKENS // 2
    step_ms = profile.engine_step_s([], [context]) * 1e3
    alone = statistics.median(gaps_alone_ms)
    together = statistics.median(gaps_together_ms)
    return LiveTerms(
        hop_s=max(0.0, statistics.median(c - w for c, w in hops_ms)) / 1e3,
        step_overhead_s=max(0.0, alone - step_ms) / 1e3,
        contention=max(0.0, together / alone - 1),
        client_ttft_ms=statistics.median(c for c, _ in hops_ms),
        worker_ttft_ms=statistics.median(w for _, w in hops_ms),
        gap_alone_ms=alone,
        gap_together_ms=together,
        engine_step_ms=step_ms,
    )


async def _stream(stub: Any, ids: list[int], max_tokens: int) -> tuple[list[float], Any]:
    """Arrival times (ms from the call) of the stream's tokens, and its usage."""
    from proto.cachesvc.v1 import cachesvc_pb2 as pb

    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
        request_id=f"calibrate-{uuid.uuid4().hex[:8]}",
    )
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async for message in stub.Generate(request):
        if message.token_ids:
            stamps.append((time.perf_counter() - start) * 1e3)
        if message.HasField("usage"):
            usage = message.usage
    return stamps, usage


def _gaps(stamps: Sequence[float]) -> list[float]:
    """Gaps between decode steps: from the second token on (the first waits on a prefill)."""
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


async def _measure(stub: Any, vocab: int) -> tuple[list[tuple[float, float]], list, list]:
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 1) for _ in range(n)]

    for _ in range(2 * NUM_WORKERS):  # first calls are slow
        await _stream(stub, ids(64), 4)
    hops = []
    for _ in range(HOP_REQUESTS):
        stamps, usage = await _stream(stub, ids(HOP_PROMPT_LEN), 1)
        hops.append((stamps[0], usage.ttft_ms))
    alone: list[float] = []
    together: list[float] = []
    for _ in range(ROUNDS):
        # Round robin: consecutive requests go to the workers in turn.
        for _ in range(NUM_WORKERS):
            alone += _gaps((await _stream(stub, ids(STREAM_PROMPT_LEN), STREAM_TOKENS))[0])
        both = [_stream(stub, ids(STREAM_PROMPT_LEN), STREAM_TOKENS) for _ in range(NUM_WORKERS)]
        for stamps, _ in await asyncio.gather(*both):
            together += _gaps(stamps)
    return hops, alone, together


async def _through_router(actors: Any, model: str) -> tuple[list[tuple[float, float]], list, list]:
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.server import RouterServer

    config = RouterConfig(port=0, response_cache_mb=0, policy="round_robin")
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            return await _measure(pb_grpc.InferenceStub(channel), router.pool.model.vocab_size)
    finally:
        await server.stop(grace_s=1.0)
        await router.close()


def measure_live_terms(profile: CostProfile, model: str | None = None) -> LiveTerms:
    """Start two workers (one torch thread each, as the live benches do) behind a router on
    this machine and measure the live path's terms against `profile` (blocking, ~1 minute)."""
    import ray

    from cachesvc.config import EngineConfig
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.text.default_model import default_model_path

    model = model or str(default_model_path())
    print("calibrating: the live path (router, Ray, 2 workers)", file=sys.stderr, flush=True)
    engine = EngineConfig.from_env(model=model, block_size=16, num_blocks=512, num_threads=1)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        namespace = f"calibrate-{uuid.uuid4().hex[:6]}"
        actors = spawn_workers(WorkerGroup(engine, NUM_WORKERS, namespace, device="cpu"))
        try:
            hops, alone, together = asyncio.run(_through_router(actors, model))
        finally:
            stop_workers(actors)
    finally:
        ray.shutdown()
    return terms_from(profile, hops, alone, together)
