"""`cachesvc bench admission`: a burst of requests past the workers' capacity, served without
and with admission (`router.policy.admission`, the router's `admit_ttft_ms`).

Two real mixed workers on this machine (the default model, or a tiny one), behind a real
router and its gRPC door. The capacity is measured first: prompts sent one at a time, each
worker serves one per median time to first token, so two serve two. Then, in each setup, the
same warm-up requests (admission learns its scale from them) and the same burst: prompts of
their own arriving evenly for `seconds` at `overload` times that capacity, four tokens each
(at twice the capacity the queue grows by half a second a second, so the later ones wait far
past the target unless they are refused).
Measured where a client sees it: how many were refused (RESOURCE_EXHAUSTED), the served ones'
TTFT, and goodput: the requests whose first token came within the target, per second from the
first arrival to the last answer. The setups share the workers; each flushes them first.

With `--itl-ms` the answers are longer (32 tokens unless `--max-tokens`), goodput counts the
requests within both targets (TTFT, and the mean gap between their tokens), and a third setup
adds admission on the streams (`admit_itl_ms`): a mixed worker computing the burst's prompts
between its streams' tokens keeps them within the target only if it is not given more.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from cachesvc.workloads.admission import (
    MAX_BURST,
    MAX_TOKENS,
    NUM_WORKERS,
    WARMUPS,
    AdmissionBenchArgs,
    SetupResult,
    format_results,
    mean_gap_s,
    prompt,
)
from cachesvc.workloads.requests import greedy_request
from cachesvc.workloads.table import write_json


async def _send(
    stub: Any, ids: Sequence[int], delay_s: float, max_tokens: int
) -> tuple[float, float] | None:
    """The request's TTFT and mean gap between its tokens (s), or None when it was refused;
    other errors are raised."""
    import grpc

    await asyncio.sleep(delay_s)
    request = greedy_request(ids, max_tokens, "bench-admission")
    start = time.perf_counter()
    times: list[float] = []
    try:
        async for message in stub.Generate(request):
            times += [time.perf_counter() - start] * len(message.token_ids)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None
    assert times, "a served request has a first token"
    return times[0], mean_gap_s(times)


async def _run_setup(
    actors: dict[Any, Any], model: str, args: AdmissionBenchArgs, setup: str, rate: float | None
) -> tuple[SetupResult, float]:
    """One setup's burst (at `rate` requests/s; None: measure the capacity first), and the
    capacity it ran at."""
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer

    ttft_ms, itl_ms = args.targets(setup)
    config = RouterConfig(port=0, response_cache_mb=0, admit_ttft_ms=ttft_ms, admit_itl_ms=itl_ms)
    await asyncio.gather(*(actor.flush.remote() for actor in actors.values()))
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    vocab = router.pool.model.vocab_size
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            warm = []
            for i in range(WARMUPS):  # one at a time: each alone on a worker
                sent = await _send(stub, prompt(-1 - i, args.num_tokens, vocab), 0.0, MAX_TOKENS)
                if sent is None:
                    raise RuntimeError(
                        f"--ttft-ms {args.ttft_ms:g} is below what a request takes alone here: "
                        "admission refuses even an idle cluster's"
                    )
                warm.append(sent[0])
            if rate is None:
                rate = args.overload * NUM_WORKERS / statistics.median(warm)
            result = SetupResult(setup, rate, args.ttft_ms, itl_target_ms=args.itl_ms)
            start = time.perf_counter()
            sends = [
                _send(stub, prompt(i, args.num_tokens, vocab), i / rate, args.answer_tokens)
                for i in range(args.burst_size(rate))
            ]
            for sent in await asyncio.gather(*sends):
                if sent is None:
                    result.refused += 1
                else:
                    result.ttft_s.append(sent[0])
                    result.itl_s.append(sent[1])
            result.span_s = time.perf_counter() - start
            return result, rate
    finally:
        await server.stop(grace_s=1.0)
        await router.close()


def measure_admission(args: AdmissionBenchArgs) -> list[SetupResult]:
    """Both setups over the same two real workers (blocking)."""
    import tempfile
    from pathlib import Path

    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig
    from workers.text.default_model import default_model_path

    results: list[SetupResult] = []
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-admission-") as tmp:
        model = args.model or str(default_model_path())
        if args.tiny:
            from workers.model.tiny import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "tiny-llama", vocab_size=512))
        engine = EngineConfig.from_env(model=model, num_threads=1)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            namespace = f"bench-admission-{uuid.uuid4().hex[:6]}"
            group = WorkerGroup(
                engine,
                NUM_WORKERS,
                namespace=namespace,
                device="cpu",
                max_queued_requests=MAX_BURST,
            )
            actors = spawn_workers(group)
            try:
                rate = None
                for setup in args.setups:
                    print(f"{setup}: running", file=sys.stderr)
                    result, rate = asyncio.run(_run_setup(actors, model, args, setup, rate))
                    results.append(result)
            finally:
                stop_workers(actors)
        finally:
            ray.shutdown()
    return results


def run_admission_bench(args: AdmissionBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench admission`; prints the table, returns 0."""
    results = measure_admission(args)
    print(format_results(results))
    write_json(args.json_path, [{**asdict(r), "goodput_rps": r.goodput_rps} for r in results])
    return 0
