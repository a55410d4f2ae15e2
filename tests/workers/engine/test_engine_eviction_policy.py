"""The engine under a non-default eviction policy: a pool too small for its prompts evicts
cached blocks all along, and the greedy tokens stay Hugging Face's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cachesvc.kv.config import ConfigError
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Conversations on one system prompt, each turn its previous prompt and more; and
    one-off prompts between the turns (a scan)."""
    gen = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 320, (n,), generator=gen).tolist()

    system = rand(24)
    convs = [system + rand(9) for _ in range(3)]
    out = []
    for _ in range(3):
        for i, conv in enumerate(convs):
            out.append(list(conv))
            out.append(rand(41))
            convs[i] = conv + rand(6)
    return out


@pytest.fixture(scope="module")
def reference(tiny_hf_model: Any, hf_greedy: Any) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, NUM_TOKENS) for p in _prompts()]


@pytest.mark.parametrize("policy", ["s3fifo", "leaf_lru", "fanout_lru"])
def test_greedy_tokens_match_hf_under_policy(
    tiny_llama_dir: Path, reference: list[list[int]], policy: str
) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=24, eviction_policy=policy)
    )
    evicted: list[bytes] = []
    engine.pool.on_evict = lambda blk, h, tokens, parent: evicted.append(h)
    outs = [engine.generate([p], GREEDY)[0] for p in _prompts()]
    assert [list(o.token_ids) for o in outs] == reference
    assert evicted  # 24 blocks hold less than the prompts wrote: it did evict
    assert sum(o.num_cached_tokens for o in outs) > 0  # and still hit
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_an_unknown_policy_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="eviction_policy"):
        EngineConfig(eviction_policy="mru")
