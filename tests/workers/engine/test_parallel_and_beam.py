"""`n` samples fork from one prefill; beam search forks beams with copy-on-write blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.beam import expand, length_score
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams


def _engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return Engine(EngineConfig(model=str(path), **kw))


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_greedy_samples_fork_from_one_prefill(
    tiny_llama_dir: Path, tiny_hf_model: Any, hf_greedy: Any
) -> None:
    prompt = _prompt(10)  # 2.5 blocks of 4: the fork copies the partial last block
    ref = hf_greedy(tiny_hf_model, prompt, 8)
    engine = _engine(tiny_llama_dir)
    outs = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, n=3))
    assert [list(o.token_ids) for o in outs] == [ref] * 3
    assert [o.num_computed_tokens for o in outs] == [10, 0, 0]  # the prompt is computed once
    _no_leak(engine)


def test_seeded_samples_equal_standalone_runs(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _prompt(13)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True)
    forked = [o.token_ids for o in engine.generate([prompt], params)]
    for i, tokens in enumerate(forked):
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True)
        assert engine.generate([prompt], alone)[0].token_ids == tokens
    _no_leak(engine)


def test_fork_without_free_blocks_falls_back_to_recompute(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_blocks=4)  # 13 tokens fill all 4 blocks
    prompt = _prompt(13)
    outs = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, n=2))
    assert outs[0].token_ids == outs[1].token_ids
    _no_leak(engine)


def test_beam_width_one_is_greedy(tiny_llama_dir: Path, tiny_hf_model: Any, hf_greedy: Any) -> None:
    prompt = _prompt(9)
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=7, beam_width=1, ignore_eos=True, temperature=0.0)
    [out] = engine.generate([prompt], params)
    assert list(out.token_ids) == hf_greedy(tiny_hf_model, prompt, 7)


def _reference_beam(model: Any, prompt: list[int], width: int, steps: int) -> list[int]:
    """Beam search over full forwards of the Hugging Face model, no KV cache at all."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    with torch.inference_mode():
        for _ in range(steps):
            lps = [
                torch.log_softmax(model(torch.tensor([prompt + b])).logits[0, -1].float(), -1)
                for b, _ in beams
            ]
            keep, _ = expand([c for _, c in beams], lps, width, eos_ids=())
            beams = [(beams[c.parent][0] + [c.token_id], c.cum_logprob) for c in keep]
    best = max(beams, key=lambda b: length_score(b[1], len(b[0]), 1.0))
    return best[0]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_a_cache_free_reference(
    tiny_llama_dir: Path, tiny_hf_model: Any, width: int
) -> None:
    prompt = _prompt(6, seed=5)
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=9, beam_width=width, ignore_eos=True, temperature=0.0)
    [out] = engine.generate([prompt], params)
    assert list(out.token_ids) == _reference_beam(tiny_hf_model, prompt, width, 9)
    assert out.finish_reason == "length"
    _no_leak(engine)


def test_beams_of_two_prompts_in_one_batch(tiny_llama_dir: Path, tiny_hf_model: Any) -> None:
    prompts = [_prompt(6, seed=5), _prompt(11, seed=6)]
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=5, beam_width=3, ignore_eos=True, temperature=0.0)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == _reference_beam(tiny_hf_model, prompt, 3, 5)
    _no_leak(engine)


def test_abort_a_beam_group_frees_everything(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=20, beam_width=3, ignore_eos=True, temperature=0.0)
    [rid] = engine.add_request(_prompt(7), params)
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    _no_leak(engine)


def test_expand_ranks_eos_like_hugging_face() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))[0]
    keep, finished = expand([0.0], [lp], width=2, eos_ids={1})
    assert [c.token_id for c in keep] == [0, 2]
    assert [c.token_id for c in finished] == [1]  # rank 1 < width: a finished hypothesis
    keep, finished = expand([0.0], [lp], width=1, eos_ids={1})
    assert [c.token_id for c in keep] == [0] and finished == []
