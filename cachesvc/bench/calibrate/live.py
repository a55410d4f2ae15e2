"""What a live deployment adds to the engine's own step times, measured through a real router and
two real Ray workers on this machine (the second half of `cachesvc simulate calibrate`).

A client sees more than `Engine.step` takes: its request and each token travel through the
router's gRPC door and Ray (`hop_s`); between two steps the worker's event loop streams the
step's outputs, a delta per sequence, and the next step waits for it (`step_overhead_s`,
`token_overhead_s`); and workers on one host share its cores with each other and with the
router (`contention`). Measured with the workers idle but for what is sent:

* hop: one-token requests of a short prompt, one at a time: the client's time to first token
  less the worker's own (`Usage.ttft_ms`, from the engine's arrival to the token);
* overheads: one decoding stream alone on a worker, then two on one worker: the median gap
  between their tokens, as the client sees them, less the median `Engine.step` of one and of
  two sequences at that context, timed in this process between the streams (so both see the
  machine alike); what the second stream adds is the per-sequence part, the rest per step;
* prefill overhead: two-token requests of 16, 64 and 128 new tokens: the worker's own TTFT,
  less the overheads, against the engine's prefill step of as many tokens timed here just
  before; per size the medians, fitted as a constant and a share of the engine's step (the
  extra grows with the step: ~15 ms at 16 tokens, ~40 at 128);
* contention: one stream on each worker at once: their median gap over the lone streams' of
  the same round, less one (per other worker stepping); the median over the rounds;
* step jitter: the lone streams' gaps less the median of their round, as quantiles (a step's
  spread around its median, which the simulator draws from).

Each is a median over several rounds, interleaved, so that work elsewhere on the machine weighs
on all alike.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.bench.calibrate.engine_timing import measure_decode, measure_prefill, timing_engine
from cachesvc.kv.calibration import nonneg_lstsq
from cachesvc.sim.jitter import quantiles

NUM_WORKERS = 2
HOP_REQUESTS = 12
HOP_PROMPT_LEN = 32
PREFILL_LENS = (16, 64, 128)  # requests of these many new tokens, each round
STREAM_PROMPT_LEN = 48
STREAM_TOKENS = 48
STREAM_CONTEXT = STREAM_PROMPT_LEN + STREAM_TOKENS // 2  # a lone stream's mean context
ROUNDS = 4
# The prefill extra's fit: a constant and a share of the step, or either alone.
_CONSTANT_AND_SHARE = ((0, 1), (0,), (1,))
JITTER_QUANTILES = 32  # the step jitter's quantiles: at probabilities 0, 1/32, ..., 1


@dataclass(frozen=True)
class LiveTerms:
    """The live path's terms of a profile, with the medians they came from (ms)."""

    hop_s: float
    step_overhead_s: float
    token_overhead_s: float
    prefill_overhead_s: float
    prefill_overhead_share: float
    contention: float
    step_jitter_s: tuple[float, ...]  # quantiles of a gap less its round's median
    client_ttft_ms: float  # the one-token requests'
    worker_ttft_ms: float
    gap_alone_ms: float
    gap_pair_ms: float
    gap_together_ms: float
    engine_step_ms: float  # the engine's own step of one sequence, timed here
    engine_pair_ms: float  # of two

    def describe(self) -> str:
        return (
            f"hop {self.hop_s * 1e3:.1f} ms (client TTFT {self.client_ttft_ms:.0f} - worker's "
            f"{self.worker_ttft_ms:.0f}); overhead {self.step_overhead_s * 1e3:.1f} ms a step "
            f"+ {self.token_overhead_s * 1e3:.1f} ms a sequence (gap alone "
            f"{self.gap_alone_ms:.1f} against the engine's {self.engine_step_ms:.1f}, two on one "
            f"worker {self.gap_pair_ms:.1f} against {self.engine_pair_ms:.1f}); contention "
            f"{self.contention:.2f} (gap with both workers stepping {self.gap_together_ms:.1f}); "
            f"a prefill step {self.prefill_overhead_s * 1e3:.1f} ms and "
            f"{self.prefill_overhead_share:.0%} more than the engine's alone; "
            f"gaps around their median {_spread(self.step_jitter_s)}"
        )


@dataclass
class LiveSamples:
    """What the live measurement saw (ms)."""

    hops_ms: list[tuple[float, float]] = field(default_factory=list)  # (client, worker) TTFT
    alone_ms: list[float] = field(default_factory=list)  # gaps: one stream on a worker
    pair_ms: list[float] = field(default_factory=list)  # two streams on one worker
    together_ms: list[float] = field(default_factory=list)  # one on each worker at once
    engine_one_ms: list[float] = field(default_factory=list)  # the engine's steps, here
    engine_pair_ms: list[float] = field(default_factory=list)
    # Per round, together's median gap over alone's: contention from the rounds' median, so
    # that other work starting or stopping between two rounds moves one ratio, not the median.
    together_ratios: list[float] = field(default_factory=list)
    # (new tokens, the worker's TTFT, the engine's prefill step here) of short requests, ms.
    prefills_ms: list[tuple[int, float, float]] = field(default_factory=list)
    # The lone streams' gaps, each less the median of its round's (the step jitter).
    alone_excess_ms: list[float] = field(default_factory=list)


def terms_from(samples: LiveSamples) -> LiveTerms:
    """The terms from the measurements (pure); none below zero."""
    median = statistics.median
    alone, pair = median(samples.alone_ms), median(samples.pair_ms)
    one, two = median(samples.engine_one_ms), median(samples.engine_pair_ms)
    step_ms, token_ms = split_overhead(alone - one, pair - two)
    ratios = samples.together_ratios or [median(samples.together_ms) / alone]
    prefill_ms, prefill_share = prefill_overhead(samples.prefills_ms, step_ms + token_ms)
    return LiveTerms(
        hop_s=max(0.0, median(c - w for c, w in samples.hops_ms)) / 1e3,
        step_overhead_s=step_ms / 1e3,
        token_overhead_s=token_ms / 1e3,
        prefill_overhead_s=prefill_ms / 1e3,
        prefill_overhead_share=prefill_share,
        contention=max(0.0, median(ratios) - 1),
        step_jitter_s=tuple(q / 1e3 for q in quantiles(samples.alone_excess_ms, JITTER_QUANTILES)),
        client_ttft_ms=median(c for c, _ in samples.hops_ms),
        worker_ttft_ms=median(w for _, w in samples.hops_ms),
        gap_alone_ms=alone,
        gap_pair_ms=pair,
        gap_together_ms=median(samples.together_ms),
        engine_step_ms=one,
        engine_pair_ms=two,
    )


def _spread(jitter_s: tuple[float, ...]) -> str:
    if not jitter_s:
        return "not measured"
    n = len(jitter_s) - 1
    at = {"min": 0, "p50": n // 2, "p90": round(0.9 * n), "max": n}
    return ", ".join(f"{k} {jitter_s[i] * 1e3:+.1f} ms" for k, i in at.items())


def prefill_overhead(
    prefills_ms: Sequence[tuple[int, float, float]], overheads_ms: float
) -> tuple[float, float]:
    """(constant ms, share) >= 0 of a live prefill step beyond the engine's: per size, the
    median engine step e and the median worker TTFT less `overheads_ms`, w; then the least
    squares of w = e * (1 + share) + constant (one size: all constant). None measured: none."""
    sizes = sorted({n for n, _, _ in prefills_ms})
    points = [
        (
            statistics.median(e for m, _, e in prefills_ms if m == n),
            statistics.median(w - overheads_ms for m, w, _ in prefills_ms if m == n),
        )
        for n in sizes
    ]
    if len(points) < 2:
        return max(0.0, points[0][1] - points[0][0] if points else 0.0), 0.0
    # extra = constant + share * e, both >= 0 (a constant alone, a share alone, or both).
    coef = nonneg_lstsq(
        [(1.0, e) for e, _ in points], [w - e for e, w in points], _CONSTANT_AND_SHARE
    )
    return (0.0, 0.0) if coef is None else (coef[0], coef[1])


def split_overhead(one_ms: float, two_ms: float) -> tuple[float, float]:
    """(per step, per sequence) >= 0 that best give `one_ms` more for a step of one sequence
    and `two_ms` for two (least squares where noise leaves no exact answer >= 0)."""
    token = two_ms - one_ms
    step = one_ms - token
    if token < 0:  # the second sequence cost nothing more: all per step
        return max(0.0, (one_ms + two_ms) / 2), 0.0
    if step < 0:  # all per sequence
        return 0.0, max(0.0, (one_ms + 2 * two_ms) / 5)
    return step, token


async def _stream(stub: Any, ids: list[int], max_tokens: int) -> tuple[list[float], Any]:
    """Arrival times (ms from the call) of the stream's tokens, and its usage."""
    from cachesvc.workloads.requests import greedy_request

    request = greedy_request(ids, max_tokens, "calibrate")
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


def _engine_steps_ms(engine: Any, batch: int) -> float:
    """The engine's decode step of `batch` sequences at the streams' mean context, here."""
    [(_, _, seconds)] = measure_decode(engine, [(batch, STREAM_CONTEXT)])
    return seconds * 1e3


async def _measure(both: Any, one: Any, vocab: int, engine: Any) -> LiveSamples:
    """`both` routes over the two workers (round robin), `one` over the first alone."""
    rng = random.Random(0)
    out = LiveSamples()

    def stream() -> Any:
        return [rng.randrange(3, vocab - 1) for _ in range(STREAM_PROMPT_LEN)], STREAM_TOKENS

    for _ in range(2 * NUM_WORKERS):  # first calls are slow
        await _stream(both, [rng.randrange(3, vocab - 1) for _ in range(64)], 4)
    for _ in range(HOP_REQUESTS):
        ids = [rng.randrange(3, vocab - 1) for _ in range(HOP_PROMPT_LEN)]
        stamps, usage = await _stream(both, ids, 1)
        out.hops_ms.append((stamps[0], usage.ttft_ms))
    for round_ in range(ROUNDS):
        # The workers are idle while the engine here steps (blocking calls, on purpose).
        out.engine_one_ms.append(_engine_steps_ms(engine, 1))
        out.engine_pair_ms.append(_engine_steps_ms(engine, 2))
        for n in PREFILL_LENS:
            [sample] = measure_prefill(engine, [(n, 0)], seed=1 + round_)  # new tokens
            ids = [rng.randrange(3, vocab - 1) for _ in range(n)]
            _, usage = await _stream(both, ids, 2)  # not finished by its first token's step
            out.prefills_ms.append((n, usage.ttft_ms, sample.seconds * 1e3))
        alone: list[float] = []
        together: list[float] = []
        for _ in range(NUM_WORKERS):  # round robin: one stream on each worker in turn
            alone += _gaps((await _stream(both, *stream()))[0])
        both_at_once = [_stream(both, *stream()) for _ in range(NUM_WORKERS)]
        for stamps, _ in await asyncio.gather(*both_at_once):
            together += _gaps(stamps)
        for stamps, _ in await asyncio.gather(*(_stream(one, *stream()) for _ in range(2))):
            out.pair_ms += _gaps(stamps)
        out.alone_ms += alone
        out.alone_excess_ms += [g - statistics.median(alone) for g in alone]
        out.together_ms += together
        out.together_ratios.append(statistics.median(together) / statistics.median(alone))
    return out


async def _through_routers(actors: Any, model: str, engine: Any) -> LiveSamples:
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer

    config = RouterConfig(port=0, response_cache_mb=0, policy="round_robin")
    first = next(iter(actors))
    routers = [
        await build_router(actors, config, model),
        await build_router({first: actors[first]}, config, model),
    ]
    servers = [RouterServer(router, config) for router in routers]
    try:
        for server in servers:
            await server.start()
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as both,
            grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as one,
        ):
            return await _measure(
                pb_grpc.InferenceStub(both),
                pb_grpc.InferenceStub(one),
                routers[0].pool.model.vocab_size,
                engine,
            )
    finally:
        for server, router in zip(servers, routers, strict=True):
            await server.stop(grace_s=1.0)
            await router.close()


def measure_live_terms(model: str | None = None) -> LiveTerms:
    """Start two workers (one torch thread each, as the live benches do) behind a router on
    this machine, and an engine in this process, and measure the live path's terms (blocking,
    ~1 minute)."""
    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig
    from workers.text.default_model import default_model_path

    model = model or str(default_model_path())
    print("calibrating: the live path (router, Ray, 2 workers)", file=sys.stderr, flush=True)
    engine = EngineConfig.from_env(model=model, block_size=16, num_blocks=512, num_threads=1)
    here = timing_engine(model, None, 1)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        namespace = f"calibrate-{uuid.uuid4().hex[:6]}"
        actors = spawn_workers(WorkerGroup(engine, NUM_WORKERS, namespace, device="cpu"))
        try:
            samples = asyncio.run(_through_routers(actors, model, here))
        finally:
            stop_workers(actors)
    finally:
        ray.shutdown()
        here.close()
    return terms_from(samples)
