"""Engines, requests and caps for `cachesvc bench tiers`.

A `Runner` holds one loaded model and one context: the prefix every request reuses, and a fresh
suffix per request so that only the prefix is ever reused. Caps are chosen per context around
the crossover bandwidth, where fetching the prefix takes as long as recomputing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SUFFIX = 16
BLOCK_SIZE = 16
# Caps as multiples of the crossover bandwidth: fetching wins clearly, ties, loses 4x.
CAP_MULTIPLES = (4.0, 1.0, 0.25)
# A forced mode predicted slower than this many recomputes is not measured (recorded as null).
SKIP_OVER_RECOMPUTE = 3.0


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def one_token() -> Any:
    from workers.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, ignore_eos=True)


def prefix_len(context: int, max_model_len: int) -> int:
    """`context` tokens, or fewer (whole blocks) when the prompt would not fit the model."""
    room = (max_model_len - SUFFIX - 1) // BLOCK_SIZE * BLOCK_SIZE
    return min(context, room)


class Runner:
    """Engines over one loaded model; `repeats` rounds of every measurement."""

    def __init__(self, loaded: Any, context: int, repeats: int, codec: str | None = None) -> None:
        self.loaded = loaded
        self.codec = codec  # every tier's codec (None: the defaults)
        self.vocab = loaded.config.vocab_size
        self.context = prefix_len(context, loaded.config.max_position_embeddings)
        self.repeats = repeats
        self.prefix = tokens(self.context, context, self.vocab)
        self._seed = 10_000

    @property
    def num_blocks(self) -> int:
        return self.context // BLOCK_SIZE

    def engine(self, tiers: Any) -> Any:
        """A warmed-up engine whose pool holds the prefix and a few more blocks."""
        from workers.config import EngineConfig
        from workers.engine.engine import Engine

        config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=self.num_blocks + 8,
            max_num_batched_tokens=self.context + 64,
            tiers=tiers,
        )
        engine = Engine(config, loaded=self.loaded)
        engine.generate([tokens(32, 1, self.vocab)], one_token())  # first calls allocate
        engine.pool.reset_cache()
        return engine

    def ttft_ms(self, engine: Any, mode: str | None = None, keep: bool = False) -> float:
        """TTFT of one request sharing the prefix (with a fresh suffix), under plan `mode`.

        Unless `keep`, the prefix then leaves the device again (demoted into the tiers, which
        already hold it)."""
        if mode is not None:
            engine.tiering.mode = mode
        self._seed += 1
        prompt = self.prefix + tokens(SUFFIX, self._seed, self.vocab)
        [out] = engine.generate([prompt], one_token())
        if not keep:
            engine.pool.reset_cache()
        return float(out.ttft_ms)


def tier_config(
    tier: str, context: int, nvme_dir: str, redis_url: str | None, codec: str | None = None
) -> Any:
    """A config with `tier` alone below the device, room for the whole prefix, in `codec` (None:
    the tier's default codec)."""
    from cachesvc.kv.config import TierConfig

    mb = context / BLOCK_SIZE * 0.8 + 16  # 0.74 MB per float32 block of SmolLM2, and spare
    codecs: dict[str, Any] = {} if codec is None else {f"{tier}_codec": codec}
    if tier == "dram":
        return TierConfig(dram_mb=mb, **codecs)
    if tier == "nvme":
        return TierConfig(nvme_path=os.path.join(nvme_dir, str(context)), nvme_mb=mb, **codecs)
    return TierConfig(redis_url=redis_url, redis_min_reuse=0, redis_timeout_s=5.0, **codecs)


@dataclass(frozen=True)
class Cap:
    """A read bandwidth cap (None: uncapped) and what it is relative to the crossover."""

    mb_per_s: float | None
    multiple: float | None  # of the crossover bandwidth


def caps_for(prefix_bytes: float, recompute_s: float) -> list[Cap]:
    """Uncapped, then the multiples of the crossover bandwidth."""
    crossover = prefix_bytes / recompute_s / 1e6
    return [Cap(None, None), *(Cap(crossover * m, m) for m in CAP_MULTIPLES)]


def slowest_cap(prefix_bytes: float, block_bytes: float, recompute_s: float) -> Cap:
    """The cap at which one block takes as long to read as the whole prefix to recompute: no
    split can pay there, so recompute must win."""
    return Cap(block_bytes / recompute_s / 1e6, block_bytes / prefix_bytes)


def estimate_s(
    recompute_s: float,
    device_s: float,
    setup_s: float,
    caps: list[Cap],
    num_tiers: int,
    repeats: int,
) -> float:
    """Rough duration of one context, from its recompute time R, the TTFT D with the prefix on
    the device (what every fetch or split pays after landing) and the start of an engine.

    Per round: R + D on the plain engine; per tier R, and per cap multiple m the choice (a
    split: about R / (1 + m) + D, fetch and compute sharing the prefix; its forced twin is not
    rerun) and a fetch at R / m + D unless skipped; uncapped, two requests at about D; the
    slowest cap (first tier) 2 R."""
    per_tier = recompute_s
    for cap in caps:
        m = cap.multiple
        if m is None:
            per_tier += 2 * device_s
            continue
        per_tier += recompute_s / (1 + m) + device_s
        if 1 / m <= SKIP_OVER_RECOMPUTE:
            per_tier += recompute_s / m + device_s
    per_round = recompute_s + device_s + num_tiers * per_tier + 2 * recompute_s
    return repeats * per_round + (num_tiers + 1) * setup_s + num_tiers * device_s  # + warm-ups
