"""`cachesvc bench tiers`: time to first token with a reused prefix in each tier, vs recompute.

For each context length, a prompt's prefix is computed once and evicted into one tier (DRAM,
NVMe, Redis) alone; then requests sharing the prefix (each with a fresh suffix) are timed with
the planner forced to fetch, to split (Cake) and left to choose, under a sweep of read bandwidth
caps; recompute (nothing cached) and the device-resident prefix are the baselines. The ratio is
the planner's choice over the best measured alternative (1.0 is a perfect choice).
The `codec` section measures lz4 and byte-plane shuffle + lz4 on the real KV of that prefix.

NVMe here is a folder on the local disk, read mostly from the page cache; on CPU the model is
slow, so every tier wins uncapped and the caps show where fetching stops paying.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from cachesvc.bench.table import format_table, write_json
from cachesvc.local_redis import local_redis, redis_server_binary
from cachesvc.types import BlockHash

TIERS = ("dram", "nvme", "redis")
SUFFIX = 16


@dataclass(frozen=True)
class TierRow:
    context: int
    tier: str  # "device" for the prefix already in the device pool
    cap_mbps: float | None
    fetch_ms: float | None
    split_ms: float | None
    recompute_ms: float
    chosen_ms: float
    chosen: str  # the planner's plan kind
    predicted_ms: float | None  # what the planner expected of its choice
    ratio: float  # chosen over the best measured alternative (device row: over recompute)


@dataclass(frozen=True)
class CodecRow:
    dtype: str
    mode: str
    ratio: float
    encode_mb_s: float
    decode_mb_s: float


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


class _Runner:
    """Engines over one loaded model; fresh suffixes so only the prefix is ever reused."""

    def __init__(self, loaded: Any, context: int, repeats: int = 1) -> None:
        self.loaded = loaded
        self.context = context
        self.repeats = repeats
        self.vocab = loaded.config.vocab_size
        self.prefix = _tokens(context, context, self.vocab)
        self._seed = 10_000

    def engine(self, tiers: Any) -> Any:
        from cachesvc.config import EngineConfig
        from workers.engine.engine import Engine

        num_blocks = self.context // 16 + 8
        config = EngineConfig(
            block_size=16,
            num_blocks=num_blocks,
            max_num_batched_tokens=self.context + 64,
            tiers=tiers,
        )
        return Engine(config, loaded=self.loaded)

    def ttft_ms(self, engine: Any) -> float:
        """One request sharing the prefix (with a fresh suffix); the prefix then leaves the
        device again (demoted into the tier, which already holds it)."""
        self._seed += 1
        prompt = self.prefix + _tokens(SUFFIX, self._seed, self.vocab)
        [out] = engine.generate([prompt], _one_token())
        engine.pool.reset_cache()
        return float(out.ttft_ms)


def _tier_config(tier: str, context: int, nvme_dir: str, redis_url: str | None) -> Any:
    from cachesvc.config import TierConfig

    mb = context / 16 * 0.8 + 16  # the whole prefix fits
    if tier == "dram":
        return TierConfig(dram_mb=mb)
    if tier == "nvme":
        return TierConfig(nvme_path=os.path.join(nvme_dir, str(context)), nvme_mb=mb)
    return TierConfig(redis_url=redis_url, redis_min_reuse=0, redis_timeout_s=5.0)


def _tier_rows(
    run: _Runner,
    tier: str,
    caps: tuple[float | None, ...],
    recompute_ms: float,
    nvme_dir: str,
    redis_url: str | None,
) -> list[TierRow]:
    engine = run.engine(_tier_config(tier, run.context, nvme_dir, redis_url))
    engine.generate([run.prefix + [101]], _one_token())
    engine.pool.reset_cache()  # the prefix is computed once, then evicted into the tier
    rows = []
    for cap in caps:
        engine.tiering.set_cap(tier, cap)
        times = _round_robin(run, engine, ("fetch", "split", "recompute", "auto"))
        plan = engine.tiering.last_plan  # of the last "auto" run
        row = TierRow(
            run.context,
            tier,
            cap,
            times["fetch"],
            times["split"],
            min(times["recompute"], recompute_ms),
            times["auto"],
            plan.kind,
            plan.predicted_s * 1e3,
            0.0,  # set once the context's best recompute time is known
        )
        rows.append(row)
        print(
            f"  {tier:5} cap {cap or '-':>5} MB/s: fetch {row.fetch_ms:.0f} ms, split "
            f"{row.split_ms:.0f}, recompute {row.recompute_ms:.0f}, chosen {row.chosen} "
            f"{row.chosen_ms:.0f}",
            flush=True,
        )
    engine.close()
    return rows


def _round_robin(run: _Runner, engine: Any, modes: tuple[str, ...]) -> dict[str, float]:
    """The best TTFT of each plan mode over `run.repeats` rounds, the modes interleaved: on a
    shared machine a burst of load then hits every mode alike, and the minimum is the least
    disturbed run."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(run.repeats):
        for mode in modes:
            engine.tiering.mode = mode
            times[mode].append(run.ttft_ms(engine))
    return {m: min(t) for m, t in times.items()}


def _context_rows(
    run: _Runner, caps: tuple[float | None, ...], nvme_dir: str, redis_url: str | None
) -> list[TierRow]:
    from cachesvc.config import TierConfig

    plain = run.engine(TierConfig())  # no tiers: what nothing cached costs
    plain.generate([_tokens(32, 1, run.vocab)], _one_token())  # warm-up
    recompute_ms = min(run.ttft_ms(plain) for _ in range(run.repeats))
    device_ms = _device_ttft_ms(run, plain)
    rows = [
        TierRow(
            run.context, "device", None, None, None, recompute_ms, device_ms, "device", None, 1.0
        )
    ]
    print(
        f"context {run.context}: recompute {recompute_ms:.0f} ms, prefix on the device "
        f"{device_ms:.0f} ms",
        flush=True,
    )
    for tier in TIERS:
        if tier == "redis" and redis_url is None:
            continue
        rows.extend(_tier_rows(run, tier, caps, recompute_ms, nvme_dir, redis_url))
    # Recompute does not depend on the tier: its best time over the whole context is the
    # baseline of every row.
    best_recompute = min(r.recompute_ms for r in rows)
    out = []
    for r in rows:
        alternatives = [t for t in (r.fetch_ms, r.split_ms) if t is not None]
        best = min([*alternatives, best_recompute])
        out.append(replace(r, recompute_ms=best_recompute, ratio=r.chosen_ms / best))
    return out


def _device_ttft_ms(run: _Runner, engine: Any) -> float:
    """TTFT with the prefix already in the device pool (no tiers: nothing moves)."""
    times = []
    for i in range(run.repeats):
        engine.generate([run.prefix + [101]], _one_token())  # the prefix stays cached
        [out] = engine.generate([run.prefix + _tokens(SUFFIX, i, run.vocab)], _one_token())
        times.append(float(out.ttft_ms))
    return min(times)


def _one_token() -> Any:
    from workers.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, ignore_eos=True)


def codec_rows(kv_blocks: list[Any]) -> list[CodecRow]:
    """Ratio and single-thread speed of lz4 and shuffle + lz4 on real KV blocks, per dtype."""
    import torch

    from cachesvc.codec import Codec
    from workers.engine.tier_setup import kv_to_numpy

    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        arrays = [kv_to_numpy(b.to(dtype)) for b in kv_blocks]
        raw = sum(a.nbytes for a in arrays)
        for mode in ("lz4", "shuffle_lz4"):
            codec = Codec("00" * 16, mode)
            hashes = [BlockHash(i.to_bytes(16, "little")) for i in range(len(arrays))]
            start = time.perf_counter()
            blobs = [codec.encode(h, None, name, a) for h, a in zip(hashes, arrays, strict=True)]
            enc = time.perf_counter() - start
            start = time.perf_counter()
            for h, blob in zip(hashes, blobs, strict=True):
                codec.decode(blob, h)
            dec = time.perf_counter() - start
            ratio = raw / sum(len(b) for b in blobs)
            rows.append(CodecRow(name, mode, ratio, raw / enc / 1e6, raw / dec / 1e6))
    return rows


def _real_kv(run: _Runner) -> list[Any]:
    import torch

    from cachesvc.config import TierConfig

    engine = run.engine(TierConfig())
    engine.generate([run.prefix + [101]], _one_token())
    ids = sorted(i for i in range(engine.pool.num_blocks) if engine.pool.block_hash(i) is not None)
    caches = engine.runner.kv_caches
    return [torch.stack([c[i] for c in caches]).clone() for i in ids]


@contextmanager
def _local_redis() -> Iterator[str | None]:
    """A throwaway redis-server, or None when none is installed."""
    if redis_server_binary() is None:
        yield None
        return
    with local_redis() as url:
        yield url


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

    contexts = (256, 512) if quick else (1024, 4096, 8192)
    caps: tuple[float | None, ...] = (None, 20.0, 2.0) if quick else (None, 200.0, 20.0, 2.0)
    if quick:
        print("--quick: contexts scaled down to 256 and 512 tokens (1K/4K/8K without it)")
    loaded = load_model(model)
    nvme_dir = tempfile.mkdtemp(prefix="cachesvc-bench-nvme-")
    rows: list[TierRow] = []
    try:
        with _local_redis() if redis_url is None else _given(redis_url) as url:
            if url is None:
                print("redis-server not installed: no Redis rows")
            for context in contexts:
                runner = _Runner(loaded, context, repeats=3)
                rows.extend(_context_rows(runner, caps, nvme_dir, url))
        codec = codec_rows(_real_kv(_Runner(loaded, contexts[-1])))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    _print(rows, codec, loaded)
    write_json(
        json_path,
        {
            "suite": "tiers",
            "model": loaded.path.name,
            "quick": quick,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "rows": [asdict(r) for r in rows],
            "codec": [asdict(c) for c in codec],
        },
    )
    return 0


@contextmanager
def _given(url: str) -> Iterator[str | None]:
    yield url


def _print(rows: list[TierRow], codec: list[CodecRow], loaded: Any) -> None:
    import torch

    print(
        f"\nmodel {loaded.path.name}, float32 KV, torch threads: {torch.get_num_threads()}; "
        "TTFT in ms"
    )
    headers = [
        "context",
        "tier",
        "cap MB/s",
        "fetch",
        "split",
        "recompute",
        "chosen",
        "plan",
        "predicted",
        "ratio",
    ]
    print(
        format_table(
            headers,
            [
                [
                    r.context,
                    r.tier,
                    r.cap_mbps or "-",
                    r.fetch_ms or "-",
                    r.split_ms or "-",
                    r.recompute_ms,
                    r.chosen_ms,
                    r.chosen,
                    r.predicted_ms or "-",
                    r.ratio,
                ]
                for r in rows
            ],
        )
    )
    print("\ncodec on the real KV of the prefix (single thread)")
    print(
        format_table(
            ["dtype", "mode", "ratio", "encode MB/s", "decode MB/s"],
            [[c.dtype, c.mode, c.ratio, c.encode_mb_s, c.decode_mb_s] for c in codec],
        )
    )
