"""`cachesvc simulate calibrate`: a cost profile measured on this machine with the real engine.

One engine over the model (the default SmolLM2 unless told otherwise), with a DRAM and an NVMe
tier (in a temporary folder), so its start-up calibration probes both tiers and the copy into
the device caches (`workers/engine/tiering/calibration.py`). Then timed engine steps:

* prefill: one request of k new tokens after a cached prefix of ctx tokens, alone in its step,
  for a few (k, ctx), the median of three; fitted by the planner's own fit
  (`cachesvc.calibration.fit_compute`);
* decode: B requests of ctx tokens each decoding together, for a few (B, ctx); the step's time
  is fitted to a fixed cost, B and the sum of contexts (non-negative).

About two minutes on one CPU core: the shapes stay within a few thousand tokens. One torch
thread by default: with another process on the second core, two-thread steps swing by 10x.

Then, unless told not to, what a live deployment adds to those steps (`calibrate_live`: the
router's and Ray's hop, the worker's own work between steps, two workers sharing the host).
What neither measures (a pull's cost, the holder's staging: `cachesvc bench kv-transfer`) is
kept from the profile being replaced.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from cachesvc.calibration import ComputeSample, fit_compute
from cachesvc.sim.calibrate_live import measure_live_terms
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, TierReadCost

BLOCK_SIZE = 16
PREFILL_SHAPES = ((128, 0), (512, 0), (1024, 0), (128, 1024), (512, 1024), (256, 2048))
DECODE_SHAPES = ((1, 256), (8, 256), (1, 1024), (4, 1024))
DECODE_STEPS = 8
PREFILL_REPEATS = 3
# A few of those shapes again: how fast the machine steps now against a profile.
SPEED_PREFILL_SHAPES = ((256, 0), (512, 0))
SPEED_DECODE_SHAPES = ((1, 256), (2, 512))
_VOCAB_LOW = 100  # token ids from here up: clear of special tokens


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(_VOCAB_LOW, vocab) for _ in range(n)]


def _engine(model: str | None, folder: str | None, threads: int | None) -> Any:
    """An engine for timing; with a `folder`, a DRAM and an NVMe tier in it."""
    from cachesvc.config import EngineConfig, TierConfig
    from workers.engine.engine import Engine

    tiers = TierConfig() if folder is None else TierConfig(dram_mb=64, nvme_path=folder, nvme_mb=64)
    config = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        kv_cache_mb=256,  # the engine's other defaults (step budget, sequences) go in the profile
        num_threads=threads,
        tiers=tiers,
    )
    return Engine(config)


def _params(max_tokens: int) -> Any:
    from workers.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _timed_step(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure_prefill(engine: Any, shapes: Sequence[tuple[int, int]]) -> list[ComputeSample]:
    """One sample per (k, ctx): the median of three timed steps prefilling k tokens after a
    cached prefix of ctx tokens (the median, not the best: live steps see the machine as it
    is, other work included)."""
    vocab = engine.loaded.config.vocab_size
    samples = []
    for i, (k, ctx) in enumerate(shapes):
        prefix = _tokens(ctx, 1000 + i, vocab)
        if ctx:
            engine.generate([prefix + _tokens(BLOCK_SIZE, 1, vocab)], _params(1))
        seconds = []
        for repeat in range(PREFILL_REPEATS):
            engine.add_request(prefix + _tokens(k, 2000 + 10 * i + repeat, vocab), _params(1))
            seconds.append(_timed_step(engine))
            while engine.has_unfinished():
                engine.step()
        samples.append(ComputeSample.of([(k, ctx)], statistics.median(seconds)))
    return samples


def measure_decode(engine: Any, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, float]]:
    """(sequences, sum of their contexts, seconds per step) of decode-only steps."""
    vocab = engine.loaded.config.vocab_size
    out = []
    engine.generate([_tokens(32, 3, vocab)], _params(DECODE_STEPS))  # the first decodes warm up
    for i, (batch, ctx) in enumerate(shapes):
        for j in range(batch):
            engine.add_request(_tokens(ctx, 5000 + 100 * i + j, vocab), _params(DECODE_STEPS + 4))
        for _ in range(64):  # until every prompt is computed (one step each is typical)
            if all(r.num_computed_tokens >= r.num_prompt_tokens for r in _running(engine)):
                break
            engine.step()
        engine.step()  # the first decode step may still allocate
        seconds = [_timed_step(engine) for _ in range(DECODE_STEPS)]
        while engine.has_unfinished():
            engine.step()
        out.append((batch, batch * (ctx + 2), sorted(seconds)[len(seconds) // 2]))
    return out


def _running(engine: Any) -> list[Any]:
    return [*engine.scheduler.waiting, *engine.scheduler.running]


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> DecodeCost:
    """Non-negative least squares of decode steps on (1, sequences, context tokens): the best
    fit among the subsets of coefficients whose values are all >= 0."""
    import numpy as np

    x = np.array([[1.0, float(b), float(c)] for b, c, _ in samples])
    y = np.array([s for _, _, s in samples])
    best: tuple[float, np.ndarray] | None = None
    for cols in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1]):
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        residual = float(((x @ full - y) ** 2).sum())
        if best is None or residual < best[0]:
            best = (residual, full)
    assert best is not None, "one coefficient alone always fits non-negative times"
    return DecodeCost(*(float(v) for v in best[1]))


def calibrate_profile(
    model: str | None = None,
    threads: int = 1,
    base: CostProfile | None = None,
    live: bool = True,
) -> CostProfile:
    """Measure a profile on this machine (see the module docstring), keeping from `base` what
    is not measured here; with `live`, the live path's terms too. Prints progress."""
    profile = measure_engine(model, threads)
    sources = ["cachesvc simulate calibrate: timed engine steps and the engine's tier probes"]
    if base is not None:
        profile = dataclasses.replace(
            profile, peer=base.peer, stage_s_per_byte=base.stage_s_per_byte
        )
        sources.append(f"peer and stage_s_per_byte kept from {base.name} (bench kv-transfer)")
    if live:
        terms = measure_live_terms(profile, model)
        profile = dataclasses.replace(
            profile,
            hop_s=terms.hop_s,
            step_overhead_s=terms.step_overhead_s,
            contention=terms.contention,
        )
        sources.append(f"live path through a router and 2 Ray workers: {terms.describe()}")
    return dataclasses.replace(profile, source="; ".join(sources))


def measure_engine(model: str | None = None, threads: int = 1) -> CostProfile:
    """The engine's own terms, measured on this machine."""
    import numpy as np

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachesvc-calibrate-") as folder:
        engine = _engine(model, folder, threads)
        try:
            tiering = engine.tiering
            assert tiering is not None, "the engine was given tiers"
            model_name = engine.loaded.path.name
            print(f"calibrating {model_name}: prefill", file=sys.stderr, flush=True)
            engine.generate([_tokens(64, 7, engine.loaded.config.vocab_size)], _params(2))
            prefill = fit_compute(measure_prefill(engine, PREFILL_SHAPES))
            print("calibrating: decode", file=sys.stderr, flush=True)
            decode = fit_decode(measure_decode(engine, DECODE_SHAPES))
            model_costs = tiering.costs.model()
            block_bytes = float(np.prod(tiering.block_shape)) * tiering.kv_caches[0].element_size()
            tiers = {
                name: TierReadCost(cost.latency_s, cost.seconds_per_byte)
                for name, cost in model_costs.tiers.items()
            }
            land = model_costs.land_s_per_block / block_bytes
            max_tokens = engine.config.max_num_batched_tokens
            max_seqs = engine.config.max_num_seqs
        finally:
            engine.close()
    took = time.perf_counter() - began
    return CostProfile(
        name="cpu-calibrated",
        description=f"{model_name} on this machine's CPU (torch backend), measured in {took:.0f} s",
        kv_bytes_per_token=block_bytes / BLOCK_SIZE,
        prefill=prefill,
        decode=decode,
        tiers=tiers,
        land_s_per_byte=land,
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max_seqs,
    )


def measure_slowdown(profile: CostProfile, model: str | None = None) -> float:
    """How much slower than `profile` predicts this machine steps the engine now (one torch
    thread): the median, over a few of the calibration's shapes, of measured over predicted
    (1.0: as calibrated; 2.0: twice as slow, from other work on the machine). ~15 s."""
    engine = _engine(model, None, 1)
    try:
        engine.generate([_tokens(64, 7, engine.loaded.config.vocab_size)], _params(2))
        prefills = measure_prefill(engine, SPEED_PREFILL_SHAPES)
        ratios = [
            sample.seconds / profile.engine_step_s([shape], [])
            for shape, sample in zip(SPEED_PREFILL_SHAPES, prefills, strict=True)
        ]
        ratios += [
            seconds / profile.engine_step_s([], [ctx // batch] * batch)
            for batch, ctx, seconds in measure_decode(engine, SPEED_DECODE_SHAPES)
        ]
    finally:
        engine.close()
    return statistics.median(ratios)
