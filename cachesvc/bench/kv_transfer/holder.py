"""Part two of `cachesvc bench kv-transfer`: the holder's own decode while it serves pulls.

Two real workers (the default model, or a tiny one). The holder computes a context, then decodes
a long greedy stream three times: alone; beside the other worker decoding a stream of its own
(what sharing the host with a busy worker costs, pulls or not); and while the other worker — with
pulls on — answers requests for that context again and again, pulling it from the holder each
time (it flushes its own cache between them). The three are taken in turns, in rounds (three, one
with `--quick`), so that a noisy minute on a shared host costs each alike. The stream's
inter-token gaps, measured where the router would see them, are compared; the puller's planner's
predicted pull time is set against the measured one.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from cachesvc.workloads.table import format_table, percentile


async def _stream_gaps(actor: Any, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds between the stream's deltas after its first (the decode steps, as seen here)."""
    from workers.sampling_params import SamplingParams

    params = asdict(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    gen = actor.generate.options(num_returns="streaming").remote(
        prompt, params, f"bench-decode-{len(prompt)}-{prompt[-1]}", None
    )
    stamps: list[float] = []
    async for ref in gen:
        await ref
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


async def _pull_again_and_again(
    puller: Any,
    holder_name: str,
    context: list[int],
    num_blocks: int,
    stop: asyncio.Event,
    tag: str,
) -> int:
    """Requests for the context on the puller, each pulling it from the holder; returns how
    many ran."""
    from workers.protocol import HolderHint
    from workers.sampling_params import SamplingParams

    params = asdict(SamplingParams(max_tokens=1, temperature=0.0))
    hint = HolderHint(holder_name, num_blocks)
    count = 0
    while not stop.is_set():
        await puller.flush.remote()
        prompt = [*context, 7 + count % 50]
        gen = puller.generate.options(num_returns="streaming").remote(
            prompt, params, f"bench-pull-{tag}-{count}", None, hint
        )
        async for ref in gen:
            await ref
        count += 1
    return count


async def _beside_a_neighbor(
    holder: Any, neighbor: Any, context: list[int], out: int, tag: str
) -> list[float]:
    """The holder's gaps while the other worker decodes a stream of its own (no pulls): what
    sharing the host with a busy worker costs, the floor for serving pulls beside one."""
    from workers.sampling_params import SamplingParams

    params = asdict(SamplingParams(max_tokens=3 * out, temperature=0.0, ignore_eos=True))
    request_id = f"bench-neighbor-{tag}"
    gen = neighbor.generate.options(num_returns="streaming").remote(
        context[::-1], params, request_id, None
    )
    first = asyncio.Event()

    async def follow() -> None:
        async for ref in gen:
            await ref
            first.set()

    following = asyncio.ensure_future(follow())
    await first.wait()  # its prompt computed: it decodes from now on
    gaps = await _stream_gaps(holder, [*context, 3 * int(tag) + 3], out)
    await neighbor.abort.remote(request_id)
    await following
    return gaps


async def _round(
    actors: dict[str, Any], names: dict[str, str], context: list[int], out: int, k: int
) -> tuple[dict[str, list[float]], int]:
    """One round: the holder's gaps alone, beside a decoding neighbor and serving pulls; and
    how many pulls it served."""
    holder, puller = actors["holder"], actors["puller"]
    alone = await _stream_gaps(holder, [*context, 3 * k + 1], out)
    beside = await _beside_a_neighbor(holder, puller, context, out, f"{k}")
    await puller.flush.remote()
    stop = asyncio.Event()
    pulls = asyncio.ensure_future(
        _pull_again_and_again(puller, names["holder"], context, len(context) // 16, stop, f"{k}")
    )
    await asyncio.sleep(0.5)  # the first pull under way before the stream starts
    serving = await _stream_gaps(holder, [*context, 3 * k + 2], out)
    stop.set()
    return {"alone": alone, "beside": beside, "serving": serving}, await pulls


async def _measure(
    actors: dict[str, Any], names: dict[str, str], context: list[int], out: int, rounds: int
) -> dict[str, Any]:
    """`rounds` rounds in turns (a noisy minute on a shared host costs every mode alike); each
    figure is the median over the rounds, a ratio the median of the rounds' ratios."""
    measured = [await _round(actors, names, context, out, k) for k in range(rounds)]
    load = await actors["puller"].stats.remote()
    t = load.tiering
    figures: dict[str, Any] = {
        "context_tokens": len(context),
        "decode_tokens": out,
        "rounds": rounds,
        "pulls": sum(n for _, n in measured),
        "pulled_blocks": t.get("peer_pulled_blocks", 0.0),
        "pull_failures": t.get("peer_failures", 0.0),
        "predicted_s": t.get("peer_predicted_s", 0.0),
        "measured_s": t.get("peer_measured_s", 0.0),
    }
    for mode in ("alone", "beside", "serving"):
        figures[f"{mode}_p50_ms"] = statistics.median(p50(g[mode]) for g, _ in measured) * 1000
        p99s = [percentile(g[mode], 99) for g, _ in measured]
        figures[f"{mode}_p99_ms"] = statistics.median(p99s) * 1000
        alone = [percentile(g["alone"], 99) for g, _ in measured]
        figures[f"{mode}_p99_vs_alone"] = statistics.median(
            a / max(b, 1e-9) for a, b in zip(p99s, alone, strict=True)
        )
    return figures


def run_holder(quick: bool, model: str | None) -> dict[str, Any]:
    """Two workers on the connected Ray cluster; returns the figures."""
    import ray

    from cachesvc.kv.config import TierConfig
    from workers.config import EngineConfig
    from workers.spawn import spawn_worker

    context_len = 512 if quick else 2048
    out = 32 if quick else 96
    namespace = ray.get_runtime_context().namespace
    names = {role: f"bench-{role}-worker" for role in ("holder", "puller")}
    actors = {}
    for role, name in names.items():
        config = EngineConfig.from_env(
            model=model,
            block_size=16,
            num_blocks=context_len // 16 * 3 + 64,
            num_threads=1,
            peer_pull=role == "puller",
            tiers=TierConfig(calibrate=False, plan="fetch"),
        )
        actors[role] = spawn_worker(role, config, name=name, namespace=namespace)
    try:
        vocab = ray.get(actors["holder"].info.remote()).vocab_size
        ray.get(actors["puller"].info.remote())
        context = [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(context_len)]
        print(f"holder: {context_len}-token context, {out} decode steps", file=sys.stderr)
        return asyncio.run(_measure(actors, names, context, out, 1 if quick else 3))
    finally:
        for actor in actors.values():
            ray.kill(actor)


def format_holder(r: dict[str, Any]) -> str:
    if not r:
        return "(not measured)"
    rows = [
        ["alone", f"{r['alone_p50_ms']:.1f}", f"{r['alone_p99_ms']:.1f}", "-", "-"],
        [
            "beside a decoding neighbor",
            f"{r['beside_p50_ms']:.1f}",
            f"{r['beside_p99_ms']:.1f}",
            f"{r['beside_p99_vs_alone']:.2f}x",
            "-",
        ],
        [
            f"serving {r['pulls']} pulls",
            f"{r['serving_p50_ms']:.1f}",
            f"{r['serving_p99_ms']:.1f}",
            f"{r['serving_p99_vs_alone']:.2f}x",
            f"{r['predicted_s']:.2f} / {r['measured_s']:.2f}",
        ],
    ]
    headers = ["holder's stream", "gap p50 ms", "gap p99 ms", "p99 vs alone", "pull s pred/meas"]
    return (
        f"{r['context_tokens']}-token context, {r['decode_tokens']} decode steps, medians of "
        f"{r['rounds']} rounds; {r['pulled_blocks']:.0f} blocks pulled, "
        f"{r['pull_failures']:.0f} failed pulls\n" + format_table(headers, rows)
    )


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
