"""Calibrating the planner's cost model for an engine's tiers.

It runs once at start: a few synthetic blocks through each tier and into the device
caches, and forward passes over scratch blocks (short and long, without and with context) to fit
the prefill cost.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from cachesvc.kv.calibration import ComputeSample, codec_cost, probe_codecs
from cachesvc.kv.config import AUTO_CODECS
from cachesvc.kv.tiers.base import TierStats
from cachesvc.kv.types import BlockId, RequestId
from workers.engine.kv_copy import kv_to_numpy, write_blocks
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from workers.engine.tiering.kv_tiering import KVTiering

_log = logging.getLogger(__name__)


def calibrate(tiering: KVTiering, runner: ModelRunner, max_tokens: int) -> None:
    """Measure the tiers and the prefill speed at start (before anything is cached)."""
    calibrate_tiers(tiering)
    calibrate_land(tiering)
    calibrate_compute(tiering, runner, max_tokens)


def calibrate_tiers(tiering: KVTiering) -> None:
    """Measure each tier's read cost (and its codec's decode) with a few synthetic blocks; a
    tier whose codec is "auto" keeps the lossless mode whose read + decode of a fetch is
    fastest."""
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(tiering.block_shape, generator=gen).to(tiering.kv_caches[0].dtype)
    array = kv_to_numpy(sample)  # compresses about as well as real KV (1.08x vs 1.06x)
    for tier in tiering.manager.all_tiers:
        codec = tiering.manager.codecs[tier.name]
        prior = tiering.costs.tiers[tier.name]
        if tier.throttle.bytes_per_s is not None:
            # A capped tier's cost is mostly its cap (and probing it would be slow): the prior,
            # with its codec's block size and decode time.
            tiering.costs.tiers[tier.name] = codec_cost(codec, tiering.dtype, array, prior)
            continue
        # Never a quantized mode unless configured: "auto" picks among lossless ones.
        auto = tiering.config.codecs[tier.name] == "auto"
        modes = AUTO_CODECS if auto else (codec.mode,)
        probed = probe_codecs(tier, codec, modes, tiering.dtype, array, prior)
        tier.stats = TierStats()  # probes are not traffic
        if probed is None:
            continue  # the tier refused the probe (full, down): keep the prior and the codec
        tiering.manager.codecs[tier.name], tiering.costs.tiers[tier.name] = probed
        if auto:
            _log.info("tier %s codec: %s (probed %s)", tier.name, probed[0].mode, modes)


@torch.inference_mode()
def calibrate_land(tiering: KVTiering, num_blocks: int = 8, repeats: int = 3) -> None:
    """Time copying fetched blocks into the device caches, over scratch blocks (so only before
    anything is cached); the best of `repeats` copies, as one stalled copy would make every
    fetch look slow until enough real landings corrected it."""
    assert tiering.pool.num_cached == 0, "calibrate before serving: it overwrites blocks"
    n = min(num_blocks, tiering.pool.num_blocks)
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn((n, *tiering.block_shape), generator=gen).to(tiering.kv_caches[0].dtype)
    arrays = [kv_to_numpy(block) for block in sample]
    ids = [BlockId(i) for i in range(n)]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        write_blocks(tiering.kv_caches, ids, arrays, tiering.dtype)
        seconds.append(time.perf_counter() - start)
    tiering.costs.observe_land(n, min(seconds))


@torch.inference_mode()
def calibrate_compute(tiering: KVTiering, runner: ModelRunner, max_tokens: int) -> None:
    """Fit the prefill cost to forward passes of a few shapes (the best of two runs each).

    They run over scratch blocks, so this only works before any block is registered.
    """
    assert tiering.pool.num_cached == 0, "calibrate before serving: it overwrites blocks"
    bs = tiering.block_size
    # Shapes scaled to the pool and the step budget (the long one at most half the pool).
    long = max(1, min(8 * bs, max_tokens, tiering.pool.num_blocks * bs // 2))
    short = max(1, min(2 * bs, long))
    _forward(runner, short, 0)  # warm-up: first calls allocate
    samples = []
    for k, ctx in ((short, 0), (long, 0), (short, long), (long, long)):
        if ctx + k > tiering.pool.num_blocks * bs:
            continue
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            _forward(runner, k, ctx)
            seconds.append(time.perf_counter() - start)
        samples.append(ComputeSample.of([(k, ctx)], min(seconds)))
    tiering.costs.calibrate_compute(samples)


def _forward(runner: ModelRunner, num_tokens: int, context: int) -> None:
    num_blocks = -(-(context + num_tokens) // runner.block_size)
    chunk = ScheduledChunk(
        RequestId("calibration"),
        (0,) * num_tokens,
        context,
        tuple(BlockId(i) for i in range(num_blocks)),
        sample=False,
    )
    runner.execute(SchedulerOutput((chunk,), ()), {})
