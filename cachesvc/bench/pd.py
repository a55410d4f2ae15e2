"""`cachesvc bench pd`: decode streams while long prompts arrive, on two mixed workers against
one prefill and one decode worker.

Two real workers on this machine (the default model, or a tiny one), behind a real router and
its gRPC door. In each setup, first `streams` long greedy decodes run alone; then the same
decodes run again while `long_prompts` long prompts (short answers) arrive one every
`interval_s`. Measured where a client sees them: the decodes' inter-token gaps (p50 / p99; the
gaps of the first phase are the baseline of the same setup) and the long prompts' time to first
token. The router decides per request (`pd_mode="auto"`): with a prefill worker it hands a long
prompt to it when the decode batch would lose more than the transfer costs.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from cachesvc.bench.table import format_table


@dataclass(frozen=True)
class PDBenchArgs:
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    json_path: str | None = None
    pd_mode: str = "auto"

    @property
    def streams(self) -> int:
        return 2 if self.quick else 4

    @property
    def decode_tokens(self) -> int:
        return 64 if self.quick else 160

    @property
    def long_prompts(self) -> int:
        return 2 if self.quick else 4

    @property
    def long_tokens(self) -> int:
        return 1024 if self.quick else 2048

    @property
    def interval_s(self) -> float:
        return 1.5


@dataclass
class PhaseResult:
    """What a client saw in one phase of one setup."""

    setup: str
    phase: str  # "decodes alone" | "with long prompts"
    gaps_s: list[float] = field(default_factory=list)  # the decodes' inter-token gaps
    ttft_s: list[float] = field(default_factory=list)  # the long prompts' TTFTs
    disaggregated: int = 0  # long prompts handed to a prefill worker
    kv_moved_tokens: int = 0

    def row(self, baseline_p99: float | None) -> list[Any]:
        p50, p99 = _pct(self.gaps_s, 50), _pct(self.gaps_s, 99)
        ratio = "-" if not baseline_p99 else f"{p99 / baseline_p99:.2f}x"
        ttft = (_pct(self.ttft_s, 50) * 1e3, _pct(self.ttft_s, 99) * 1e3) if self.ttft_s else None
        return [
            self.setup,
            self.phase,
            f"{p50 * 1e3:.1f}",
            f"{p99 * 1e3:.1f}",
            ratio,
            "-" if ttft is None else f"{ttft[0]:.0f}",
            "-" if ttft is None else f"{ttft[1]:.0f}",
            f"{self.disaggregated}/{len(self.ttft_s)}" if self.ttft_s else "-",
        ]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 1) for _ in range(n)]


async def _stream(stub: Any, ids: list[int], max_tokens: int) -> tuple[list[float], Any]:
    """Arrival times of the stream's messages (from the call), and its usage."""
    from proto.cachesvc.v1 import cachesvc_pb2 as pb

    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
        request_id=f"bench-pd-{uuid.uuid4().hex[:8]}",
    )
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async for message in stub.Generate(request):
        if message.token_ids:
            stamps.append(time.perf_counter() - start)
        if message.HasField("usage"):
            usage = message.usage
    return stamps, usage


async def _phase(
    stub: Any, args: PDBenchArgs, setup: str, with_prompts: bool, vocab: int, seed: int
) -> PhaseResult:
    rng = random.Random(seed)
    result = PhaseResult(setup, "with long prompts" if with_prompts else "decodes alone")
    decodes = [
        asyncio.create_task(_stream(stub, _ids(rng, 48, vocab), args.decode_tokens))
        for _ in range(args.streams)
    ]
    if with_prompts:
        await asyncio.sleep(2 * args.interval_s)  # the decodes are under way
        longs = []
        for _ in range(args.long_prompts):
            ids = _ids(rng, args.long_tokens, vocab)
            longs.append(asyncio.create_task(_stream(stub, ids, 8)))
            await asyncio.sleep(args.interval_s)
        for stamps, usage in await asyncio.gather(*longs):
            result.ttft_s.append(stamps[0])
            if usage is not None and usage.prefill_worker_id:
                result.disaggregated += 1
                result.kv_moved_tokens += usage.kv_transfer_tokens
    for stamps, _ in await asyncio.gather(*decodes):
        result.gaps_s += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return result


async def _run_setup(actors: dict[Any, Any], model: str, args: PDBenchArgs, setup: str) -> list:
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.server import RouterServer

    config = RouterConfig(port=0, response_cache_mb=0, pd_mode=args.pd_mode)
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    vocab = router.pool.model.vocab_size
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            await _stream(stub, _ids(random.Random(0), 64, vocab), 4)  # warm the path
            alone = await _phase(stub, args, setup, False, vocab, 1)
            mixed = await _phase(stub, args, setup, True, vocab, 2)
    finally:
        await server.stop(grace_s=1.0)
        await router.close()
    return [alone, mixed]


def run_pd_bench(args: PDBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench pd`; prints the table, returns 0."""
    import tempfile
    from pathlib import Path

    import ray

    from cachesvc.config import EngineConfig
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.text.default_model import default_model_path

    setups = {"2 mixed": (0, 0), "1 prefill + 1 decode": (1, 1)}
    results: list[PhaseResult] = []
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-pd-") as tmp:
        model = args.model or str(default_model_path())
        if args.tiny:
            from workers.model.tiny import write_tiny_model

            folder = Path(tmp) / "tiny-llama"
            model = str(write_tiny_model(folder, vocab_size=512, max_position_embeddings=4096))
        blocks = (args.streams * (48 + args.decode_tokens) + 2 * args.long_tokens) // 16 + 64
        engine = EngineConfig.from_env(
            model=model, block_size=16, num_blocks=blocks * 2, num_threads=1, peer_pull=True
        )
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            for setup, (num_prefill, num_decode) in setups.items():
                namespace = f"bench-pd-{uuid.uuid4().hex[:6]}"
                group = WorkerGroup(
                    engine,
                    2,
                    namespace=namespace,
                    device="cpu",
                    num_prefill=num_prefill,
                    num_decode=num_decode,
                )
                actors = spawn_workers(group)
                try:
                    print(f"{setup}: running", file=sys.stderr)
                    results += asyncio.run(_run_setup(actors, model, args, setup))
                finally:
                    stop_workers(actors)
        finally:
            ray.shutdown()
    print(format_results(results))
    if args.json_path:
        import json

        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


def format_results(results: list[PhaseResult]) -> str:
    headers = [
        "setup",
        "phase",
        "gap p50 ms",
        "gap p99 ms",
        "p99 vs alone",
        "long TTFT p50 ms",
        "long TTFT p99 ms",
        "handed off",
    ]
    rows = []
    baseline: dict[str, float] = {}
    for r in results:
        if r.phase == "decodes alone":
            baseline[r.setup] = _pct(r.gaps_s, 99)
        rows.append(r.row(None if r.phase == "decodes alone" else baseline.get(r.setup)))
    return format_table(headers, rows)
