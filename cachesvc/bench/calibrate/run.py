"""`cachesvc simulate calibrate`: a cost profile measured on this machine with the real engine.

One engine over the model (the default SmolLM2 unless told otherwise), with a DRAM and an NVMe
tier (in a temporary folder), so its start-up calibration probes both tiers and the copy into
the device caches (`workers/engine/tiering/calibration.py`). Then timed engine steps:

* prefill: one request of k new tokens after a cached prefix of ctx tokens, alone in its step,
  for a few (k, ctx) from 16 tokens up, the median of three; fitted by the planner's own fit
  (`cachesvc.kv.calibration.fit_compute`), each error relative to its step's time;
* decode: B requests of ctx tokens each decoding together, for a few (B, ctx); the step's time
  is fitted to a fixed cost, B and the sum of contexts (non-negative, errors relative); then
  steps of 1 to 8 sequences at a short context, kept as a table (small batches are far from
  linear on a CPU).

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

from cachesvc.bench.calibrate.engine_timing import (
    BLOCK_SIZE,
    greedy,
    measure_decode,
    measure_prefill,
    timing_engine,
    tokens,
)
from cachesvc.bench.calibrate.live import STREAM_CONTEXT, LiveTerms, measure_live_terms
from cachesvc.kv.calibration import ComputeSample, fit_compute, nonneg_lstsq
from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, TierReadCost

# Short chunks too: a step's fixed cost is most of a short prompt's (the routing bench's prompts
# are 8-128 tokens), and the fits weigh each shape's error relative to its time.
PREFILL_SHAPES = (
    (16, 0),
    (32, 0),
    (64, 0),
    (128, 0),
    (512, 0),
    (1024, 0),
    (32, 512),
    (128, 1024),
    (512, 1024),
    (256, 2048),
)
DECODE_SHAPES = ((1, 64), (2, 64), (1, 256), (8, 256), (1, 1024), (4, 1024))
# Decode steps of 1..BATCH_TABLE sequences at a short context, each the median of three rounds.
BATCH_TABLE, BATCH_CONTEXT, BATCH_ROUNDS = 8, 64, 3
# A few of those shapes again: how fast the machine steps now against a profile.
SPEED_PREFILL_SHAPES = ((256, 0), (512, 0))
SPEED_DECODE_SHAPES = ((1, 256), (2, 512))


def fit_prefill(samples: Sequence[ComputeSample]) -> ComputeCost:
    """The planner's fit, each sample's error relative to its time (a short prompt's step
    counts as much as a long one's)."""
    return fit_compute(samples, [1 / s.seconds**2 for s in samples])


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> DecodeCost:
    """Non-negative least squares of decode steps on (1, sequences, context tokens), errors
    relative to each step's time: the best fit among the subsets of coefficients whose values
    are all >= 0."""
    subsets = ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1])
    rows = [(1.0, float(b), float(c)) for b, c, _ in samples]
    seconds = [s for _, _, s in samples]
    coef = nonneg_lstsq(rows, seconds, subsets, [1 / s for s in seconds])
    assert coef is not None, "one coefficient alone always fits non-negative times"
    base, per_seq, per_context = coef
    return DecodeCost(base, per_seq, per_context)


def calibrate_profile(
    model: str | None = None,
    threads: int = 1,
    base: CostProfile | None = None,
    live: bool = True,
    engine: bool = True,
) -> CostProfile:
    """Measure a profile on this machine (see the module docstring), keeping from `base` what
    is not measured here: with `engine`, the engine's terms; with `live`, the live path's.
    Prints progress."""
    if not engine and base is None:
        raise ValueError("measuring the live path alone needs a profile to add it to")
    sources = []
    if engine:
        profile = measure_engine(model, threads)
        sources.append("cachesvc simulate calibrate: timed engine steps and its tier probes")
        if base is not None:
            profile = dataclasses.replace(
                profile, peer=base.peer, stage_s_per_byte=base.stage_s_per_byte
            )
            sources.append(f"peer and stage_s_per_byte kept from {base.name} (bench kv-transfer)")
    else:
        assert base is not None
        profile = base
        sources.append(base.source.partition("; live path")[0])
    if live:
        terms = measure_live_terms(model)
        slowdown = terms_slowdown(profile, terms)
        profile = with_live_terms(profile, terms)
        sources.append(
            f"live path through a router and 2 Ray workers: {terms.describe()}; the engine "
            f"stepped {slowdown:.2f}x its profile meanwhile: hop and overheads divided by that"
        )
    return dataclasses.replace(profile, source="; ".join(sources))


def with_live_terms(profile: CostProfile, terms: LiveTerms) -> CostProfile:
    """`profile` with the live path's `terms`, its times brought to the profile's speed: the
    engine stepped `terms.engine_step_ms` here while they were measured, against the profile's
    own step for it (other work on the machine slows both alike)."""
    slowdown = terms_slowdown(profile, terms)
    return dataclasses.replace(
        profile,
        hop_s=terms.hop_s / slowdown,
        step_overhead_s=terms.step_overhead_s / slowdown,
        token_overhead_s=terms.token_overhead_s / slowdown,
        prefill_overhead_s=terms.prefill_overhead_s / slowdown,
        prefill_overhead_share=terms.prefill_overhead_share,  # a ratio: the same at any speed
        contention=terms.contention,
        step_jitter_s=tuple(q / slowdown for q in terms.step_jitter_s),
    )


def terms_slowdown(profile: CostProfile, terms: LiveTerms) -> float:
    """How much slower than `profile` the engine stepped while `terms` were measured."""
    return terms.engine_step_ms / 1e3 / profile.engine_step_s([], [STREAM_CONTEXT])


def measure_engine(model: str | None = None, threads: int = 1) -> CostProfile:
    """The engine's own terms, measured on this machine."""
    import numpy as np

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachesvc-calibrate-") as folder:
        engine = timing_engine(model, folder, threads)
        try:
            tiering = engine.tiering
            assert tiering is not None, "the engine was given tiers"
            model_name = engine.loaded.path.name
            print(f"calibrating {model_name}: prefill", file=sys.stderr, flush=True)
            engine.generate([tokens(64, 7, engine.loaded.config.vocab_size)], greedy(2))
            prefill = fit_prefill(measure_prefill(engine, PREFILL_SHAPES))
            print("calibrating: decode", file=sys.stderr, flush=True)
            decode = fit_decode(measure_decode(engine, DECODE_SHAPES))
            decode = dataclasses.replace(decode, by_batch_s=measure_batch_table(engine, decode))
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


def measure_batch_table(engine: Any, fitted: DecodeCost) -> tuple[float, ...]:
    """Decode steps of 1..`BATCH_TABLE` sequences at `BATCH_CONTEXT` tokens each, less their
    context's share by the `fitted` cost: the median of `BATCH_ROUNDS` rounds over every
    batch size (a busy moment weighs on one round of each, not on one size)."""
    shapes = [(b, BATCH_CONTEXT) for b in range(1, BATCH_TABLE + 1)]
    rounds = [measure_decode(engine, shapes) for _ in range(BATCH_ROUNDS)]
    return tuple(
        statistics.median(r[i][2] for r in rounds) - fitted.per_context_token_s * rounds[0][i][1]
        for i in range(len(shapes))
    )


def measure_slowdown(profile: CostProfile, model: str | None = None) -> float:
    """How much slower than `profile` predicts this machine steps the engine now (one torch
    thread): the median, over a few of the calibration's shapes, of measured over predicted
    (1.0: as calibrated; 2.0: twice as slow, from other work on the machine). ~15 s."""
    engine = timing_engine(model, None, 1)
    try:
        engine.generate([tokens(64, 7, engine.loaded.config.vocab_size)], greedy(2))
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


def speed_ratio(measured_with: CostProfile, profile: CostProfile) -> float:
    """What a slowdown measured against `measured_with` is against `profile`: the median, over
    `measure_slowdown`'s shapes, of the first's predicted step over the second's."""
    steps: list[tuple[list[tuple[int, int]], list[int]]] = [
        ([shape], []) for shape in SPEED_PREFILL_SHAPES
    ]
    steps += [([], [ctx] * batch) for batch, ctx in SPEED_DECODE_SHAPES]
    return statistics.median(
        measured_with.engine_step_s(c, d) / profile.engine_step_s(c, d) for c, d in steps
    )
