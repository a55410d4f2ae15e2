"""`cachesvc bench tiers`: time to first token with a reused prefix in each tier, vs recompute.

For each context length, a plain engine measures recomputing the prefix and finding it on the
device. Then, per tier (DRAM, NVMe, Redis, each alone below the device), a fresh engine computes
the prefix once (a recompute of its own), lets it leave into the tier, fetches it once and
splits once untimed (a first read is slower; the planner learns what an overlap costs from the
splits it sees), and times requests that share it (each with a fresh suffix) with the
planner forced to fetch, to split (Cake) and left to choose, under read bandwidth caps chosen
around the context's crossover bandwidth (prefix bytes over recompute time): uncapped, 4x, 1x
and 0.25x of it, and on DRAM a cap so slow that one block reads as long as the prefix
recomputes. Every round interleaves the plans, so a burst of load on a shared machine hits
them alike; the minimum over rounds is the least disturbed run. A cap whose plans all take
under a tenth of a recompute gets 5 rounds even at contexts too long to repeat recomputes. A
forced plan predicted slower than 3 recomputes is not measured but recorded as null, with the
reason; the forced plan that is the choice's own plan is not run twice (`same_as_chosen`): its
time is the choice's.

The ratio is the planner's choice over the best measured alternative of the same engine (1.0 is
a perfect choice); the summary checks the issue's goals. `bandwidth` times a whole-prefix fetch
from DRAM (the tier read and the copy into the device caches) against a plain memory copy of as
many bytes; `codec` measures lz4 and byte-plane shuffle + lz4 on the real KV of the prefix.

NVMe here is a folder on the local disk, read mostly from the page cache.
"""

from __future__ import annotations

import math
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from cachesvc.bench.table import write_json
from cachesvc.bench.tiers_report import (
    BandwidthRow,
    TierRow,
    codec_rows,
    print_report,
)
from cachesvc.bench.tiers_runner import (
    BLOCK_SIZE,
    SKIP_OVER_RECOMPUTE,
    Cap,
    Runner,
    caps_for,
    estimate_s,
    memcpy_gb_s,
    slowest_cap,
    tier_config,
)
from cachesvc.local_redis import local_redis, redis_server_binary

TIERS = ("dram", "nvme", "redis")
FULL = ((1024, 3), (4096, 1), (8192, 1))  # (context, rounds): fewer rounds where a run is long
QUICK = ((256, 3), (512, 2))
FORCED = ("fetch", "split")
CHEAP_ROUNDS, CHEAP_SHARE = 5, 0.1


@dataclass
class _Sweep:
    """Measurements of one tier engine, per cap (by index)."""

    recompute: list[float]  # engine-wide: a recompute reads nothing, so no cap matters
    samples: dict[int, dict[str, list[float]]]  # "auto" and each plan's own
    plans: dict[int, Any]  # the latest "auto" plan
    skipped: dict[int, dict[str, str]]
    same: dict[int, str]  # the forced plan that the choice's run also stood for


def _tier_rows(
    run: Runner, tier: str, caps: list[Cap], nvme_dir: str, redis_url: str | None
) -> tuple[list[TierRow], BandwidthRow | None]:
    engine = run.engine(tier_config(tier, run.context, nvme_dir, redis_url))
    # Nothing is cached yet: this computes the prefix (a recompute), which then leaves into the
    # tier alone.
    sweep = _Sweep([run.ttft_ms(engine, "auto")], {}, {}, {}, {})
    flush = getattr(engine.tiering.manager.tier(tier), "flush", None)
    if flush is not None:
        flush()  # the prefix is on disk before any read is timed
    run.ttft_ms(engine, "fetch")  # warm-up, not timed: the first read of a tier is slower
    # And one split, not timed: the planner learns online what overlapping a read with compute
    # costs on this machine; a serving engine learns it from its first splits.
    run.ttft_ms(engine, "split")
    for i in range(len(caps)):
        sweep.samples[i] = {mode: [] for mode in ("auto", *FORCED, "recompute")}
        sweep.skipped[i] = {}
    for round_ in range(max(run.repeats, CHEAP_ROUNDS)):
        if 0 < round_ < run.repeats:
            sweep.recompute.append(run.ttft_ms(engine, "recompute"))
        for i, cap in enumerate(caps):
            if round_ < run.repeats or _cheap(sweep, i):
                _measure_cap(run, engine, tier, cap, i, sweep)
    bandwidth = _dram_bandwidth(run, engine) if tier == "dram" else None
    engine.close()
    rows = [_row(run.context, tier, cap, i, sweep) for i, cap in enumerate(caps)]
    return rows, bandwidth


def _cheap(sweep: _Sweep, i: int) -> bool:
    """Whether every plan measured at cap `i` took under `CHEAP_SHARE` of a recompute: such
    rows get `CHEAP_ROUNDS` rounds even where a recompute is too long to repeat, since a near
    tie between two fast plans is decided by noise in a single round."""
    measured = [t for mode, t in sweep.samples[i].items() if mode != "recompute" and t]
    return bool(measured) and max(max(t) for t in measured) < CHEAP_SHARE * min(sweep.recompute)


def _measure_cap(run: Runner, engine: Any, tier: str, cap: Cap, i: int, sweep: _Sweep) -> None:
    """One round at one cap: the choice first, then each other plan its prediction allows.

    The forced plan that is the choice's own plan is not run again: its time is the choice's
    (a second run of the same work would only measure noise between the two)."""
    engine.tiering.set_cap(tier, cap.mb_per_s)
    samples = sweep.samples[i]
    samples["auto"].append(run.ttft_ms(engine, "auto"))
    plan = sweep.plans[i] = engine.tiering.last_plan
    same = _forced_twin(plan)
    if same is not None:
        samples[same].append(samples["auto"][-1])
        sweep.same[i] = same
    for mode, predicted_s in zip(FORCED, (plan.fetch_only_s, plan.best_split_s), strict=True):
        if mode == same:
            continue
        if predicted_s > SKIP_OVER_RECOMPUTE * plan.recompute_only_s:
            sweep.skipped[i][mode] = f"predicted over {SKIP_OVER_RECOMPUTE:g}x recompute"
            continue
        samples[mode].append(run.ttft_ms(engine, mode))
    ms = {m: f"{t[-1]:.0f}" for m, t in samples.items() if t}
    where = "-" if cap.mb_per_s is None else f"{cap.mb_per_s:.3g}"
    print(f"  {tier:5} cap {where:>6} MB/s: {ms}, chosen {plan.kind}", flush=True)


def _forced_twin(plan: Any) -> str | None:
    """The forced mode that would run exactly the chosen plan, if any (a fetch that bypasses
    part of the hits, for one, has none)."""
    if plan.kind == "recompute":
        return "recompute"
    predicted = {"fetch": plan.fetch_only_s, "split": plan.best_split_s}.get(plan.kind)
    if predicted is not None and math.isclose(plan.predicted_s, predicted):
        return str(plan.kind)
    return None


def _row(context: int, tier: str, cap: Cap, i: int, sweep: _Sweep) -> TierRow:
    samples, plan = sweep.samples[i], sweep.plans[i]
    best = {m: min(t) if t else None for m, t in samples.items()}
    best["recompute"] = min(sweep.recompute + samples["recompute"])
    recompute = best["recompute"]
    # The choice ran a forced plan's very work: that plan's best time is the choice's.
    chosen = best[sweep.same.get(i, "auto")]
    assert chosen is not None and recompute is not None
    alternatives = [t for t in (best["fetch"], best["split"], recompute) if t is not None]
    predicted = {
        "fetch": plan.fetch_only_s * 1e3,
        "split": plan.best_split_s * 1e3,
        "recompute": plan.recompute_only_s * 1e3,
    }
    return TierRow(
        context,
        tier,
        cap.mb_per_s,
        cap.multiple,
        best["fetch"],
        best["split"],
        recompute,
        chosen,
        plan.kind,
        plan.predicted_s * 1e3,
        chosen / min(alternatives),
        predicted,
        {m: why for m, why in sweep.skipped[i].items() if best[m] is None},
        sweep.same.get(i),
    )


def _dram_bandwidth(run: Runner, engine: Any, repeats: int = 3) -> BandwidthRow:
    """The best of `repeats` uncapped whole-prefix fetches, from the tiering's own timing."""
    engine.tiering.set_cap("dram", None)
    loads = []
    for _ in range(repeats):
        run.ttft_ms(engine, "fetch")
        loads.append(engine.tiering.last_load)
    load = min(loads, key=lambda t: t.read_s + t.land_s)
    fetch = load.num_bytes / (load.read_s + load.land_s) / 1e9
    copy, numpy = memcpy_gb_s(load.num_bytes)
    return BandwidthRow(
        run.context,
        load.num_bytes,
        load.read_s * 1e3,
        load.land_s * 1e3,
        fetch,
        copy,
        numpy,
        fetch / copy,
        fetch / numpy,
    )


def _plain_rows(run: Runner, want_kv: bool) -> tuple[TierRow, list[Any], float]:
    """Recompute and the prefix already on the device, on an engine without tiers; the KV of
    the prefix when `want_kv` (for the codec); and how long the engine took to start."""
    from cachesvc.config import TierConfig

    start = time.perf_counter()
    plain = run.engine(TierConfig())
    setup_s = time.perf_counter() - start
    recompute, device, kv = [], [], []
    for _ in range(run.repeats):
        recompute.append(run.ttft_ms(plain, keep=True))
        device.append(run.ttft_ms(plain, keep=True))  # the prefix is still on the device
        if want_kv:
            kv = _cached_kv(plain)
        plain.pool.reset_cache()
    row = TierRow(
        context=run.context,
        tier="device",
        cap_mbps=None,
        cap_multiple=None,
        fetch_ms=None,
        split_ms=None,
        recompute_ms=min(recompute),
        chosen_ms=min(device),
        chosen="device",
        predicted_ms=None,
        ratio=None,
    )
    return row, kv, setup_s


def _cached_kv(engine: Any) -> list[Any]:
    import torch

    pool = engine.pool
    ids = [i for i in range(pool.num_blocks) if pool.block_hash(i) is not None]
    return [torch.stack([c[i] for c in engine.runner.kv_caches]).clone() for i in ids]


def _context_rows(
    run: Runner, tiers: tuple[str, ...], nvme_dir: str, redis_url: str | None, want_kv: bool
) -> tuple[list[TierRow], list[BandwidthRow], list[Any]]:
    device, kv, setup_s = _plain_rows(run, want_kv)
    recompute_s = device.recompute_ms / 1e3
    c = run.loaded.config
    block_bytes = c.num_layers * 2 * BLOCK_SIZE * c.num_kv_heads * c.head_dim * 4  # float32 KV
    prefix_bytes = run.num_blocks * block_bytes
    caps = caps_for(prefix_bytes, recompute_s)
    slowest = slowest_cap(prefix_bytes, block_bytes, recompute_s)
    expect = estimate_s(recompute_s, device.chosen_ms / 1e3, setup_s, caps, len(tiers), run.repeats)
    print(
        f"context {run.context}: recompute {device.recompute_ms:.0f} ms, on the device "
        f"{device.chosen_ms:.0f} ms, crossover {prefix_bytes / recompute_s / 1e6:.3g} MB/s; "
        f"about {expect:.0f} s for this context",
        flush=True,
    )
    rows, bandwidth = [device], []
    for tier in tiers:
        # Under the slowest cap every tier is only its cap: one tier shows it.
        tier_caps = [*caps, slowest] if tier == tiers[0] else caps
        tier_rows, bw = _tier_rows(run, tier, tier_caps, nvme_dir, redis_url)
        rows.extend(tier_rows)
        if bw is not None:
            bandwidth.append(bw)
    return rows, bandwidth, kv


@contextmanager
def _redis(url: str | None) -> Iterator[str | None]:
    """The given URL, else a throwaway redis-server, else None when none is installed."""
    if url is not None or redis_server_binary() is None:
        yield url
        return
    with local_redis() as local:
        yield local


def run_tiers_bench(
    model: str | None,
    quick: bool,
    json_path: str | None,
    redis_url: str | None = None,
    threads: int | None = None,
) -> int:
    """Print the tables (and write JSON); returns the process exit status."""
    import torch

    if threads:
        # One thread is steadier on a shared machine: oversubscribed OpenMP threads stall.
        torch.set_num_threads(threads)
    # A terminated run still stops the redis-server it started and removes its NVMe folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from workers.model.loader import load_model

    start = time.perf_counter()
    contexts = QUICK if quick else FULL
    if quick:
        print("--quick: contexts scaled down to 256 and 512 tokens (1K/4K/8K without it)")
    loaded = load_model(model)
    nvme_dir = tempfile.mkdtemp(prefix="cachesvc-bench-nvme-")
    rows: list[TierRow] = []
    bandwidth: list[BandwidthRow] = []
    try:
        with _redis(redis_url) as url:
            tiers = TIERS if url is not None else TIERS[:2]
            if url is None:
                print("redis-server not installed: no Redis rows")
            for context, repeats in contexts:
                began = time.perf_counter()
                run = Runner(loaded, context, repeats)
                last = context == contexts[-1][0]
                context_rows, bw, kv = _context_rows(run, tiers, nvme_dir, url, want_kv=last)
                rows.extend(context_rows)
                bandwidth.extend(bw)
                print(f"context {run.context}: {time.perf_counter() - began:.0f} s", flush=True)
        codec = codec_rows(kv)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    header = (
        f"model {loaded.path.name}, float32 KV, torch threads: {torch.get_num_threads()}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    summary = print_report(rows, bandwidth, codec, header)
    write_json(
        json_path,
        {
            "suite": "tiers",
            "model": loaded.path.name,
            "quick": quick,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "duration_s": time.perf_counter() - start,
            "rows": [asdict(r) for r in rows],
            "summary": asdict(summary),
            "bandwidth": [asdict(b) for b in bandwidth],
            "codec": [asdict(c) for c in codec],
        },
    )
    return 0
