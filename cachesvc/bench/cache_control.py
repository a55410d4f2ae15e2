"""`cachesvc bench cache-control`: does retention keep a prefix through a flood, do quotas keep
one tenant's cache from another's flood, does every answer's usage add up.

One real worker on this machine (the default model, or a tiny one) with a small device pool and
no lower tiers, behind a real router and its gRPC door with two tenants' tokens and the
operator's. The requests are `cachesvc.workloads.cache_control`'s; setups run one after the other
on the same worker, its cache flushed in between (`Admin.Flush`).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.workloads.cache_control import (
    ALONE,
    BLOCK_SIZE,
    QUESTION_LEN,
    QUOTA_SETUPS,
    QUOTA_SHARE,
    QUOTAS,
    RETAINED,
    RETENTION_S,
    RETENTION_SETUPS,
    CacheControlResults,
    CacheControlShape,
    QuotaResult,
    RetentionResult,
    UsageCheck,
    flood_prompts,
    format_results,
    num_flood_prompts,
    random_prompt,
)

OPERATOR_TOKEN = "bench-operator-token"
TENANT_TOKENS = {"alice": "bench-alice-token", "bob": "bench-bob-token"}


@dataclass(frozen=True)
class CacheControlBenchArgs:
    quick: bool = False
    model: str | None = None
    tiny: bool = False  # a tiny random model: the hit figures hold, the times mean little
    json_path: str | None = None

    @property
    def shape(self) -> CacheControlShape:
        return CacheControlShape(self.quick)


@dataclass(frozen=True)
class _Answer:
    ttft_ms: float
    usage: Any


class _Client:
    """The bench's calls through the router's gRPC door, as one tenant or the operator."""

    def __init__(self, channel: Any, results: CacheControlResults) -> None:
        from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

        self.inference = pb_grpc.InferenceStub(channel)
        self.admin = pb_grpc.AdminStub(channel)
        self.results = results

    async def generate(
        self,
        tenant: str,
        ids: Sequence[int],
        retention_s: int = 0,
        retention_tokens: int | None = None,
    ) -> _Answer:
        """One greedy token for `ids` as `tenant`; its usage is checked and kept."""
        from proto.cachesvc.v1 import cachesvc_pb2 as pb

        request = pb.GenerateRequest(
            request_id=f"bench-cc-{uuid.uuid4().hex[:8]}",
            prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
            sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            no_response_cache=True,
        )
        if retention_s:
            request.retention_s = retention_s
        if retention_tokens is not None:
            request.retention_tokens = retention_tokens
        metadata = (("authorization", f"Bearer {TENANT_TOKENS[tenant]}"),)
        start = time.perf_counter()
        ttft, usage = None, None
        async for message in self.inference.Generate(request, metadata=metadata):
            if ttft is None:
                ttft = (time.perf_counter() - start) * 1000
            if message.HasField("usage"):
                usage = message.usage
        assert ttft is not None and usage is not None, "an answer without usage"
        read = sum(usage.cached_tokens.values())
        self.results.usage.append(UsageCheck(usage.prompt_tokens, read, usage.cache_write_tokens))
        return _Answer(ttft, usage)

    async def flush(self) -> None:
        from proto.cachesvc.v1 import cachesvc_pb2 as pb

        await self.admin.Flush(pb.FlushRequest(), metadata=self._operator())

    async def set_share(self, share: float) -> None:
        """Both tenants' share of each tier (1.0: no quota)."""
        from proto.cachesvc.v1 import cachesvc_pb2 as pb

        for tenant in TENANT_TOKENS:
            quota = pb.TenantQuota(
                tenant=tenant, share=share, max_retention_s=86400, retention_share=0.5
            )
            await self.admin.SetTenantQuota(
                pb.SetTenantQuotaRequest(quota=quota), metadata=self._operator()
            )

    @staticmethod
    def _operator() -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {OPERATOR_TOKEN}"),)


async def _retention_setup(
    client: _Client, shape: CacheControlShape, vocab: int, setup: str
) -> RetentionResult:
    prefix = random_prompt(1, shape.prefix_tokens, vocab)
    retention = RETENTION_S if setup == RETAINED else 0
    span = shape.prefix_tokens if retention else None

    def prompt(question: int) -> list[int]:
        return prefix + random_prompt(100 + question, QUESTION_LEN, vocab)

    cold = await client.generate("alice", prompt(0), retention, span)
    warm = [
        (await client.generate("alice", prompt(1 + i), retention, span)).ttft_ms
        for i in range(shape.warm_probes)
    ]
    floods = flood_prompts(shape, vocab, seed=7, count=num_flood_prompts(shape))
    for ids in floods:
        await client.generate("bob", ids)
    after = await client.generate("alice", prompt(99), retention, span)
    return RetentionResult(
        setup=setup,
        prefix_tokens=shape.prefix_tokens,
        flood_tokens=sum(len(ids) for ids in floods),
        cold_ttft_ms=cold.ttft_ms,
        warm_ttft_ms=statistics.median(warm),
        after_ttft_ms=after.ttft_ms,
        after_cached_tokens=sum(after.usage.cached_tokens.values()),
        retained_tokens=cold.usage.retained_tokens,
    )


async def _quota_setup(
    client: _Client, shape: CacheControlShape, vocab: int, setup: str
) -> QuotaResult:
    await client.set_share(QUOTA_SHARE if setup == QUOTAS else 1.0)
    working = [
        random_prompt(200 + i, shape.working_prompt_tokens, vocab) for i in range(shape.working_set)
    ]
    floods = iter(flood_prompts(shape, vocab, seed=11, count=10**6 // shape.flood_prompt_tokens))
    prompt_tokens = cached = bob_tokens = 0
    for round_no in range(shape.rounds):
        for ids in working:
            answer = await client.generate("alice", ids)
            if round_no:  # the first round is cold in every setup
                prompt_tokens += answer.usage.prompt_tokens
                cached += sum(answer.usage.cached_tokens.values())
            if setup == ALONE:
                continue
            for _ in range(shape.floods_per_request):
                flood = next(floods)
                await client.generate("bob", flood)
                bob_tokens += len(flood)
    return QuotaResult(setup, prompt_tokens, cached, bob_tokens)


async def _run(
    model: str, actors: dict[Any, Any], args: CacheControlBenchArgs
) -> CacheControlResults:
    import grpc

    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer
    from router.tenants import TenantToken

    config = RouterConfig(
        port=0,
        response_cache_mb=0,
        auth_token=OPERATOR_TOKEN,
        tenant_tokens=tuple(TenantToken(t, token) for t, token in TENANT_TOKENS.items()),
    )
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    vocab = router.pool.model.vocab_size
    results = CacheControlResults()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            client = _Client(channel, results)
            await client.generate("alice", random_prompt(3, 256, vocab))  # warm the path
            for setup in RETENTION_SETUPS:
                print(f"retention: {setup}", file=sys.stderr)
                await client.flush()
                shape = args.shape
                results.retention.append(await _retention_setup(client, shape, vocab, setup))
            for setup in QUOTA_SETUPS:
                print(f"quotas: {setup}", file=sys.stderr)
                await client.flush()
                results.quotas.append(await _quota_setup(client, args.shape, vocab, setup))
        return results
    finally:
        await server.stop(grace_s=1.0)
        await router.close()


def measure_cache_control(args: CacheControlBenchArgs) -> CacheControlResults:
    """Run both scenarios over one real worker (blocking)."""
    from cachesvc.bench.live import bench_model, local_ray
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig

    with bench_model(args.model, args.tiny, max_positions=8192) as model, local_ray():
        engine = EngineConfig.from_env(
            model=model, block_size=BLOCK_SIZE, num_blocks=args.shape.num_blocks, num_threads=1
        )
        group = WorkerGroup(engine, 1, namespace=f"bench-cc-{uuid.uuid4().hex[:6]}", device="cpu")
        actors = spawn_workers(group)
        try:
            return asyncio.run(_run(model, actors, args))
        finally:
            stop_workers(actors)


def run_cache_control_bench(args: CacheControlBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench cache-control`; prints the tables. Returns 1
    when an answer's usage does not add up, else 0."""
    results = measure_cache_control(args)
    print(format_results(results))
    if args.json_path:
        import json
        from dataclasses import asdict

        with open(args.json_path, "w") as f:
            json.dump({"args": asdict(args), **asdict(results)}, f, indent=1)
    return 1 if results.usage_failures else 0
