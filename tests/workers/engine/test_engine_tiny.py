"""Engine on a tiny random Llama: every scheduling path gives Hugging Face's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.engine import Engine, PromptError
from workers.sampling_params import SamplingParams

NUM_TOKENS = 12
LENGTHS = (3, 9, 17, 31, 1, 44, 64, 70)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_hf_model: Any, hf_greedy: Any) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, NUM_TOKENS) for p in _prompts()]


def _engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return Engine(EngineConfig(model=str(path), **kw))


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _assert_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_integrity()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill across several steps
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
        {"block_size": 16},
        {"block_size": 1},
    ],
    ids=["batch", "chunked", "unchunked", "block16", "block1"],
)
def test_batch_matches_hf(tiny_llama_dir: Path, reference: list[list[int]], kw: Any) -> None:
    engine = _engine(tiny_llama_dir, **kw)
    outs = engine.generate(_prompts(), GREEDY)
    assert [list(o.token_ids) for o in outs] == reference
    _assert_no_leak(engine)


def test_one_at_a_time_matches_hf(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = _engine(tiny_llama_dir)
    for prompt, ref in zip(_prompts(), reference, strict=True):
        [out] = engine.generate([prompt], GREEDY)
        assert list(out.token_ids) == ref
    _assert_no_leak(engine)


def test_preemption_keeps_tokens_exact(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    # 40 blocks of 4 tokens cannot hold all eight requests at once (they need ~80 blocks).
    engine = _engine(tiny_llama_dir, num_blocks=40)
    outs = engine.generate(_prompts(), GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [list(o.token_ids) for o in outs] == reference
    _assert_no_leak(engine)


def test_seeded_sampling_is_reproducible(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    prompts = _prompts()[:3]
    alone = engine.generate([prompts[1]], params)[0].token_ids
    batched = engine.generate(prompts, params)[1].token_ids
    assert alone == batched
    other = engine.generate([prompts[1]], SamplingParams(max_tokens=10, seed=43, ignore_eos=True))
    assert other[0].token_ids != alone


def test_seeded_stream_continued_elsewhere_draws_the_same_tokens(tiny_llama_dir: Path) -> None:
    # What a mid-stream failover does: another engine gets the prompt plus the tokens already
    # sent, and output_offset says how many there were.
    prompt = _prompts()[3]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    whole = list(_engine(tiny_llama_dir).generate([prompt], params)[0].token_ids)
    for sent in (1, 6, 15):
        rest = SamplingParams(
            max_tokens=16 - sent, temperature=1.0, seed=7, ignore_eos=True, output_offset=sent
        )
        [out] = _engine(tiny_llama_dir).generate([prompt + whole[:sent]], rest)
        assert whole[:sent] + list(out.token_ids) == whole
    shifted = SamplingParams(max_tokens=15, temperature=1.0, seed=7, ignore_eos=True)
    [out] = _engine(tiny_llama_dir).generate([prompt + whole[:1]], shifted)
    assert list(out.token_ids) != whole[1:], "without the offset the draws restart"


def test_seeded_sampling_survives_preemption(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    roomy = _engine(tiny_llama_dir).generate(_prompts(), params)
    tight_engine = _engine(tiny_llama_dir, num_blocks=40)
    tight = tight_engine.generate(_prompts(), params)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    _assert_no_leak(tight_engine)


def test_n_samples_use_distinct_seeds(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    outs = engine.generate([_prompts()[2]], params)
    assert len(outs) == 3
    assert len({o.token_ids for o in outs}) > 1
    assert (
        outs[1].token_ids
        == engine.generate(
            [_prompts()[2]], SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True)
        )[0].token_ids
    )
    _assert_no_leak(engine)


def test_stop_token_and_max_tokens(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = _engine(tiny_llama_dir)
    ref = reference[3]
    stop_at = ref[4]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop_token_ids=(stop_at,))
    [out] = engine.generate([_prompts()[3]], params)
    assert list(out.token_ids) == ref[: ref.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    [out] = engine.generate([_prompts()[3]], SamplingParams(max_tokens=3, temperature=0.0))
    assert list(out.token_ids) == ref[:3] and out.finish_reason == "length"


def test_bad_prompts_are_rejected_without_leaks(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, max_model_len=100)
    for bad in ([], [5000], list(range(100)), "text without tokenizer"):
        with pytest.raises(PromptError):
            engine.generate([bad], GREEDY)
    _assert_no_leak(engine)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_abort_frees_blocks(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    [rid] = engine.add_request(_prompts()[5], GREEDY)
    engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort(rid)
    _assert_no_leak(engine)


def _shared_prefix_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 320, (37,), generator=gen).tolist()
    other = torch.randint(0, 320, (21,), generator=gen).tolist()
    suffixes = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (1, 5, 9, 3, 14)]
    return [prefix + s for s in suffixes] + [other + s for s in suffixes[:3]]


@pytest.fixture(scope="module")
def shared_reference(tiny_hf_model: Any, hf_greedy: Any) -> list[list[int]]:
    return [hf_greedy(tiny_hf_model, p, NUM_TOKENS) for p in _shared_prefix_prompts()]


SCHEMES = ["naive", "split", "ragged", "cascade", "multi_item", "custom_mask", "auto"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
def test_prefill_schemes_match_hf(
    tiny_llama_dir: Path, shared_reference: list[list[int]], scheme: str, caching: bool
) -> None:
    engine = _engine(tiny_llama_dir, prefill_scheme=scheme, enable_prefix_caching=caching)
    outs = engine.generate(_shared_prefix_prompts(), GREEDY)
    assert [list(o.token_ids) for o in outs] == shared_reference
    prompt_lens = [len(p) for p in _shared_prefix_prompts()]
    for out, n in zip(outs, prompt_lens, strict=True):
        assert out.num_cached_tokens + out.num_computed_tokens == n
    cached = sum(o.num_cached_tokens for o in outs)
    if not caching or scheme == "naive":
        assert cached == 0
    else:
        # Every sharer after the first of its group reuses the full blocks of the prefix
        # (block size 4): 4 * 36 tokens of group one, 2 * 20 of group two.
        assert cached == 4 * 36 + 2 * 20
    _assert_no_leak(engine)


def test_cache_salt_isolates_tenants(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prompt = _shared_prefix_prompts()[0]
    engine.generate([prompt], GREEDY, cache_salt="a")
    [same] = engine.generate([prompt], GREEDY, cache_salt="a")
    [other] = engine.generate([prompt], GREEDY, cache_salt="b")
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0
    assert same.token_ids == other.token_ids


@pytest.mark.parametrize("scheme", ["cascade", "multi_item", "custom_mask"])
def test_scheme_runs_on_shared_groups_and_decode(
    tiny_llama_dir: Path, shared_reference: list[list[int]], scheme: str
) -> None:
    """The scheme is really used, in prefill and in decode with two prefix groups."""
    engine = _engine(tiny_llama_dir, prefill_scheme=scheme)
    seen = set()
    for prompt in _shared_prefix_prompts():
        engine.add_request(prompt, GREEDY)
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = list(out.token_ids)
        seen.add(engine.runner.last_scheme)
    assert scheme in seen
    assert [results[f"req-{i}"] for i in range(len(shared_reference))] == shared_reference
    _assert_no_leak(engine)
