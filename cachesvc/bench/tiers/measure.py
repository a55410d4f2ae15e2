"""What `cachesvc bench tiers` measures at one context, on engines from a `Runner`: each tier
engine's rounds under each cap and its rows, the plain engine's recompute and prefix on the
device (and the prefix's KV), a whole-prefix DRAM fetch against a plain copy, and the codec on
that KV."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from cachesvc.bench.tiers.report import BandwidthRow, CodecRow, TierRow
from cachesvc.bench.tiers.runner import SKIP_OVER_RECOMPUTE, Cap, Runner, tier_config
from cachesvc.kv.types import BlockHash

FORCED = ("fetch", "split")
CHEAP_ROUNDS, CHEAP_SHARE = 5, 0.1


def plain_rows(run: Runner, want_kv: bool) -> tuple[TierRow, list[Any], float]:
    """Recompute and the prefix already on the device, on an engine without tiers; the KV of
    the prefix when `want_kv` (for the codec); and how long the engine took to start."""
    from cachesvc.kv.config import TierConfig

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


@dataclass
class _Sweep:
    """Measurements of one tier engine, per cap (by index)."""

    recompute: list[float]  # engine-wide: a recompute reads nothing, so no cap matters
    samples: dict[int, dict[str, list[float]]]  # "auto" and each plan's own
    plans: dict[int, Any]  # the latest "auto" plan
    skipped: dict[int, dict[str, str]]
    same: dict[int, str]  # the forced plan that the choice's run also stood for


def tier_rows(
    run: Runner, tier: str, caps: list[Cap], nvme_dir: str, redis_url: str | None
) -> tuple[list[TierRow], BandwidthRow | None]:
    """One row per cap of a fresh engine with `tier` alone below the device (the engine is
    closed after), and on DRAM the uncapped fetch against a plain copy."""
    engine = run.engine(tier_config(tier, run.context, nvme_dir, redis_url, run.codec))
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
    copy, numpy = _memcpy_gb_s(load.num_bytes)
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


def _memcpy_gb_s(num_bytes: int, repeats: int = 3) -> tuple[float, float]:
    """Best bandwidth of a plain copy of `num_bytes` between preallocated buffers: torch
    `copy_`, numpy `copyto` (which may use non-temporal stores for large copies)."""
    import numpy as np
    import torch

    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    src_np, dst_np = src.numpy(), dst.numpy()
    best_torch = best_numpy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best_torch = min(best_torch, time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(dst_np, src_np)
        best_numpy = min(best_numpy, time.perf_counter() - start)
    return num_bytes / best_torch / 1e9, num_bytes / best_numpy / 1e9


def codec_rows(kv_blocks: list[Any]) -> list[CodecRow]:
    """Ratio and single-thread speed of lz4 and shuffle + lz4 on real KV blocks, per dtype."""
    import torch

    from cachesvc.kv.codec import Codec
    from workers.engine.kv_copy import kv_to_numpy

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
