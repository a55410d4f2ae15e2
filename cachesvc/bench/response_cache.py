"""`cachesvc bench response-cache`: repeated deterministic requests through a real router and
real Ray workers; time to first token and end-to-end latency of response-cache hits against
generation, measured by the client in the same run, and the hit ratio.

Each of `prompts` distinct greedy prompts is sent `repeats` times, round after round: the first
round generates, later rounds are hits. One more round with `no_response_cache` measures
generation again with the prefix already in the KV cache (the fair baseline: a hit must beat a
warm KV cache, not a cold one).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cachesvc.workloads.table import format_table, percentile, write_json


@dataclass(frozen=True)
class ResponseCacheBenchArgs:
    prompts: int = 8
    repeats: int = 4
    max_tokens: int = 16
    workers: int = 1
    model: str | None = None
    tiny: bool = False
    json_path: str | None = None


@dataclass(frozen=True)
class Sample:
    kind: str  # "generated (cold KV)", "generated (warm KV)", "response cache"
    ttft_s: float
    latency_s: float


def _rows(samples: list[Sample]) -> list[list[Any]]:
    kinds = list(dict.fromkeys(s.kind for s in samples))
    rows = []
    for kind in kinds:
        ttft = [s.ttft_s * 1e3 for s in samples if s.kind == kind]
        e2e = [s.latency_s * 1e3 for s in samples if s.kind == kind]
        rows.append(
            [
                kind,
                len(ttft),
                statistics.median(ttft),
                percentile(ttft, 99),
                statistics.median(e2e),
                percentile(e2e, 99),
            ]
        )
    return rows


async def _send(stub: Any, ids: list[int], args: ResponseCacheBenchArgs, opt_out: bool) -> Sample:
    from proto.cachesvc.v1 import cachesvc_pb2 as pb

    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        no_response_cache=opt_out,
    )
    sent, ttft, hit = time.perf_counter(), None, False
    async for message in stub.Generate(request, timeout=600):
        if ttft is None and message.token_ids:
            ttft = time.perf_counter() - sent
        if message.HasField("usage"):
            hit = message.usage.from_response_cache
    assert ttft is not None
    latency = time.perf_counter() - sent
    if hit:
        return Sample("response cache", ttft, latency)
    return Sample("generated (warm KV)" if opt_out else "generated (cold KV)", ttft, latency)


async def _drive(actors: Any, model: str | None, args: ResponseCacheBenchArgs) -> list[Sample]:
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer

    config = RouterConfig(port=0)
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    prompts = [[(97 * p + 13 * i) % 300 + 5 for i in range(200)] for p in range(args.prompts)]
    samples: list[Sample] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            await _send(stub, [1, 2, 3, 4], args, opt_out=True)  # warm-up: first calls are slow
            for _ in range(args.repeats):
                for ids in prompts:
                    samples.append(await _send(stub, ids, args, opt_out=False))
            for ids in prompts:
                samples.append(await _send(stub, ids, args, opt_out=True))
    finally:
        await server.stop(grace_s=1.0)
        await router.close()
    return samples


def run_response_cache_bench(args: ResponseCacheBenchArgs) -> int:
    """Blocking entry point; prints the table and the hit ratio, returns 0."""
    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig

    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-") as tmp:
        model = args.model
        if args.tiny:
            from workers.model.tiny import write_tiny_model

            folder = Path(tmp) / "tiny-llama"
            model = str(write_tiny_model(folder, vocab_size=512, max_position_embeddings=2048))
        engine = EngineConfig.from_env(model=model, block_size=16, num_threads=1)
        ray.init(include_dashboard=False, log_to_driver=False)
        actors: dict[Any, Any] = {}
        try:
            actors = spawn_workers(WorkerGroup(engine, args.workers, device="cpu"))
            samples = asyncio.run(_drive(actors, model, args))
        finally:
            stop_workers(actors)
            ray.shutdown()
    headers = ["answer", "requests", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "e2e p99 ms"]
    rows = _rows(samples)
    print(format_table(headers, rows))
    cacheable = [s for s in samples if s.kind != "generated (warm KV)"]
    hits = sum(s.kind == "response cache" for s in cacheable)
    print(
        f"\nhit ratio {hits / len(cacheable):.2f} ({hits} of {len(cacheable)} cacheable requests)"
    )
    by_kind = {row[0]: row for row in rows}
    if "response cache" in by_kind and "generated (warm KV)" in by_kind:
        hit, warm = by_kind["response cache"], by_kind["generated (warm KV)"]
        print(
            f"e2e p50: a hit takes {hit[4] / warm[4]:.3f}x the time of a warm-KV generation "
            f"(TTFT {hit[2] / warm[2]:.3f}x)"
        )
    write_json(
        args.json_path,
        {"args": asdict(args), "rows": rows, "samples": [asdict(s) for s in samples]},
    )
    return 0
