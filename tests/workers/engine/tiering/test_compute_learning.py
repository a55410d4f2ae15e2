"""What a worker learns of its prefill cost from its own steps: steps that compute some prompt
teach it, decode-only steps (bound by reading the weights, not by their few tokens) do not."""

from __future__ import annotations

from pathlib import Path

from cachesvc.kv.config import TierConfig
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams


def test_decode_only_steps_teach_nothing_of_the_prefill_cost(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir),
        block_size=4,
        num_blocks=128,
        tiers=TierConfig(dram_mb=1, calibrate=False),
    )
    engine = Engine(config)
    assert engine.tiering is not None
    costs = engine.tiering.costs
    prompt = [(7 * j) % 300 + 3 for j in range(40)]
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], long)  # one step computes the prompt, 99 only decode
    assert [s.num_tokens for s in costs._recent] == [40.0]
    learnt = costs.compute
    other = [(11 * j) % 300 + 3 for j in range(24)]
    engine.generate([prompt, other], long)  # the cached prompt's tail and the other prompt
    assert len(costs._recent) == 2 and costs._recent[-1].num_tokens > 1
    assert costs.compute != learnt
