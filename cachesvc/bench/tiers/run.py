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

NVMe here is a folder on the local disk, read mostly from the page cache. `--codec` stores the
prefix in every tier in one codec (a quantized one: ~27% of the bytes); the caps stay multiples
of the float32 prefix's crossover bandwidth, so a row is one link speed whatever the codec.
"""

from __future__ import annotations

import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from cachesvc.bench.local_redis import local_redis, redis_server_binary
from cachesvc.bench.tiers.measure import codec_rows, plain_rows, tier_rows
from cachesvc.bench.tiers.report import BandwidthRow, TierRow, print_report
from cachesvc.bench.tiers.runner import BLOCK_SIZE, Runner, caps_for, estimate_s, slowest_cap
from cachesvc.workloads.table import write_json

TIERS = ("dram", "nvme", "redis")
FULL = ((1024, 3), (4096, 1), (8192, 1))  # (context, rounds): fewer rounds where a run is long
QUICK = ((256, 3), (512, 2))


def _context_rows(
    run: Runner, tiers: tuple[str, ...], nvme_dir: str, redis_url: str | None, want_kv: bool
) -> tuple[list[TierRow], list[BandwidthRow], list[Any]]:
    device, kv, setup_s = plain_rows(run, want_kv)
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
        measured, bw = tier_rows(run, tier, tier_caps, nvme_dir, redis_url)
        rows.extend(measured)
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
    tier_codec: str | None = None,
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
                run = Runner(loaded, context, repeats, tier_codec)
                last = context == contexts[-1][0]
                context_rows, bw, kv = _context_rows(run, tiers, nvme_dir, url, want_kv=last)
                rows.extend(context_rows)
                bandwidth.extend(bw)
                print(f"context {run.context}: {time.perf_counter() - began:.0f} s", flush=True)
        codec = codec_rows(kv)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    header = (
        f"model {loaded.path.name}, float32 KV, tier codec {tier_codec or 'default'}, "
        f"torch threads: {torch.get_num_threads()}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    summary = print_report(rows, bandwidth, codec, header)
    write_json(
        json_path,
        {
            "suite": "tiers",
            "model": loaded.path.name,
            "quick": quick,
            "tier_codec": tier_codec,
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
