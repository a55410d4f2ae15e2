"""The engine in bfloat16: its KV blocks go through the tiers and come back as computed, and on
SmolLM2 its greedy tokens are Hugging Face's in bfloat16 up to the first near-tie."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cachesvc.bench.dtype_agreement import (
    NEAR_TIE,
    divergence,
    engine_greedy,
    held_prompts,
    hf_greedy,
    load_hf,
)
from cachesvc.kv.config import TierConfig
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.cpu_dtype import cpu_bf16_features
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_bf16_features(), reason="no native bfloat16 on this CPU")

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(7)).tolist()
A, B = PREFIX + [1, 2, 3], PREFIX + [4, 5, 6, 7]


def _engine(path: Path, tiers: TierConfig | None = None, **kw: Any) -> Engine:
    config = EngineConfig(
        model=str(path),
        dtype="bfloat16",
        block_size=BS,
        num_blocks=64,
        tiers=tiers or TierConfig(),
        **kw,
    )
    return Engine(config)


@pytest.mark.parametrize(
    "kind,codec", [("dram", "raw"), ("nvme", "raw"), ("nvme", "shuffle_lz4"), ("dram", "lz4")]
)
def test_bf16_blocks_round_trip_the_tiers(
    tiny_llama_dir: Path, tmp_path: Path, kind: str, codec: str
) -> None:
    expected = _engine(tiny_llama_dir, enable_prefix_caching=False)
    [want] = expected.generate([B], GREEDY)
    if kind == "dram":
        tiers = TierConfig(dram_mb=1, dram_codec=codec, plan="fetch")
    else:
        tiers = TierConfig(nvme_path=str(tmp_path), nvme_mb=1, nvme_codec=codec, plan="fetch")
    engine = _engine(tiny_llama_dir, tiers)
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    engine.generate([A], GREEDY)
    engine.pool.reset_cache()  # A's device blocks leave: demoted into the tier
    [out] = engine.generate([B], GREEDY)
    assert out.cached_tokens_by_tier.get(kind) == len(PREFIX)
    assert list(out.token_ids) == list(want.token_ids)
    engine.close()


@pytest.mark.slow
def test_smollm2_bf16_greedy_matches_hf_bf16_up_to_a_near_tie() -> None:
    engine = Engine(EngineConfig(dtype="bfloat16", num_blocks=512))
    prompts = held_prompts(engine.tokenizer)
    ours = engine_greedy(engine, prompts, 24)
    hf_bf16 = load_hf(engine.loaded.path, torch.bfloat16)
    exact = load_hf(engine.loaded.path, torch.float32)
    agreed = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        div = divergence(exact, prompt, tokens, hf_greedy(hf_bf16, prompt, 24))
        # Past a tie the two runs continue different texts: only the first divergence counts.
        assert div.margin is None or abs(div.margin) < NEAR_TIE, (prompt, div)
        agreed += div.margin is None
    assert agreed >= len(prompts) // 2  # ties are rare: most prompts agree all the way
