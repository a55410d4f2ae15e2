"""LlamaModel over the paged cache against Hugging Face transformers on tiny random models.

Each variant is a random HF model saved as safetensors and loaded with `load_model`; our logits at
every position must match HF's full forward, whether a sequence runs alone, in a ragged batch with
others, in two prefill chunks, or token by token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.attention import get_backend
from workers.attention.layout import build_layout
from workers.kernels import linear as linear_kernel
from workers.model.config import ModelConfig
from workers.model.llama import LlamaModel
from workers.model.loader import LoadedModel, load_model
from workers.model.rope import rope_inv_freq

BLOCK_SIZE = 16

SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # Large weights make attention peaky, so a wrong position or mask shows in the logits.
    "initializer_range": 0.2,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_theta": 500.0}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3, "tie_word_embeddings": True}),
    "yarn-attention-bias": ("llama", {"rope_scaling": YARN, "attention_bias": True}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
}


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request, starting at position `start`, with the request's pages."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]


def paged_forward(
    model: LlamaModel, kv_caches: list[torch.Tensor], chunks: Sequence[Chunk]
) -> list[torch.Tensor]:
    """One ragged forward over `chunks` with the torch backend; logits of every new token."""
    qo_lens = [len(c.tokens) for c in chunks]
    kv_lens = [c.start + len(c.tokens) for c in chunks]
    layout = build_layout(qo_lens, kv_lens, [c.block_table for c in chunks], BLOCK_SIZE)
    token_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
    positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])
    backend = get_backend("torch")
    logits = model(token_ids, positions, kv_caches, layout, backend, torch.arange(len(token_ids)))
    assert logits.dtype == torch.float32
    return list(logits.split(qo_lens))


def hf_logits(hf_model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Hugging Face's logits `[len(tokens), vocab]` for one sequence, no cache."""
    with torch.inference_mode():
        return hf_model(torch.tensor([list(tokens)])).logits[0].float()


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    """max |ours - ref| within `rtol` of the logit scale max |ref|."""
    assert ours.shape == ref.shape
    error = float((ours - ref).abs().max() / ref.abs().max())
    assert error < rtol, f"relative logit error {error:.2e} >= {rtol:.0e}"


def make_hf_model(arch: str, overrides: dict[str, Any], seed: int = 0) -> Any:
    """A random float32 HF causal LM of the tiny shape."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    model_cls = transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    config = config_cls(**{**SHAPE, "tie_word_embeddings": False, **overrides})
    return model_cls.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, our LoadedModel) on the same weights, via save_pretrained + load_model."""
    hf = make_hf_model(*VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, load_model(folder)


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (length,), generator=gen).tolist()


def fresh_cache(loaded: LoadedModel) -> list[torch.Tensor]:
    return loaded.model.allocate_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)


def test_single_sequence_prefill(pair: Any) -> None:
    hf, loaded = pair
    tokens = prompt(45, seed=1)
    # Scattered, out-of-order pages: the cache must be read through the block table.
    (ours,) = paged_forward(loaded.model, fresh_cache(loaded), [Chunk(tokens, 0, [7, 2, 30])])
    assert_close_logits(ours, hf_logits(hf, tokens))


def test_ragged_batch_matches_each_sequence_alone(pair: Any) -> None:
    hf, loaded = pair
    prompts = [prompt(23, seed=2), prompt(1, seed=3), prompt(40, seed=4)]
    tables = [[3, 9], [0], [12, 5, 17]]
    chunks = [Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    outs = paged_forward(loaded.model, fresh_cache(loaded), chunks)
    for ours, tokens in zip(outs, prompts, strict=True):
        assert_close_logits(ours, hf_logits(hf, tokens))


def test_chunked_prefill_reads_first_chunk_kv(pair: Any) -> None:
    hf, loaded = pair
    tokens, split, table = prompt(50, seed=5), 21, [4, 11, 1, 8]
    cache = fresh_cache(loaded)
    (first,) = paged_forward(loaded.model, cache, [Chunk(tokens[:split], 0, table)])
    (second,) = paged_forward(loaded.model, cache, [Chunk(tokens[split:], split, table)])
    assert_close_logits(torch.cat([first, second]), hf_logits(hf, tokens))


def test_decode_token_by_token(pair: Any) -> None:
    hf, loaded = pair
    tokens, table, prefill_len = prompt(20, seed=6), [6, 13], 14
    cache = fresh_cache(loaded)
    outs = paged_forward(loaded.model, cache, [Chunk(tokens[:prefill_len], 0, table)])
    for pos in range(prefill_len, len(tokens)):
        outs += paged_forward(loaded.model, cache, [Chunk(tokens[pos : pos + 1], pos, table)])
    assert_close_logits(torch.cat(outs), hf_logits(hf, tokens))


@pytest.mark.parametrize("native", [True, False], ids=["packed-kernel", "f-linear"])
def test_decode_matches_on_either_linear_path(
    pair: Any, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode on the packed-panel kernel (the CPU default where it builds) or on
    `F.linear`: the same logits as HF's either way, and the kernel runs only where asked."""
    hf, loaded = pair
    calls: list[int] = []
    real = linear_kernel.packed_linear
    monkeypatch.setattr(
        linear_kernel, "packed_linear", lambda *args: calls.append(1) or real(*args)
    )
    before = loaded.model.native_linear
    loaded.model.native_linear = native
    try:
        tokens, table, prefill_len = prompt(12, seed=8), [3, 10], 9
        cache = fresh_cache(loaded)
        outs = paged_forward(loaded.model, cache, [Chunk(tokens[:prefill_len], 0, table)])
        for pos in range(prefill_len, len(tokens)):
            outs += paged_forward(loaded.model, cache, [Chunk(tokens[pos : pos + 1], pos, table)])
    finally:
        loaded.model.native_linear = before
    assert_close_logits(torch.cat(outs), hf_logits(hf, tokens))
    # 4 matmuls a layer and the LM head, per forward pass: the prefill's and each decode step's.
    expected = (len(tokens) - prefill_len + 1) * (4 * SHAPE["num_hidden_layers"] + 1)
    assert len(calls) == (expected if native and linear_kernel.load() else 0)


def test_logits_only_for_requested_rows(pair: Any) -> None:
    _, loaded = pair
    tokens = torch.tensor(prompt(10, seed=7))
    layout = build_layout([10], [10], [[0]], BLOCK_SIZE)
    args = (tokens, torch.arange(10), fresh_cache(loaded), layout, get_backend("torch"))
    rows = torch.tensor([9, 3])
    picked = loaded.model(*args, rows)
    full = loaded.model(*args, torch.arange(10))
    assert picked.shape == (2, SHAPE["vocab_size"])
    torch.testing.assert_close(picked, full[rows])


@pytest.mark.parametrize(
    "scaling",
    [
        LLAMA3,
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "mscale": 0.7, "mscale_all_dim": 1.0},
        {"rope_type": "linear", "factor": 3.0},
    ],
)
def test_rope_frequencies_match_transformers(scaling: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{**SHAPE, "rope_scaling": dict(scaling)})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    inv_freq, scale = rope_inv_freq(ModelConfig.from_hf_dict(hf_config.to_dict()))
    torch.testing.assert_close(inv_freq, ref_freq, rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_allocate_kv_cache_shape(tmp_path: Path) -> None:
    hf = make_hf_model("llama", {})
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path).model
    caches = model.allocate_kv_cache(5, 8, dtype=torch.bfloat16)
    assert len(caches) == SHAPE["num_hidden_layers"]
    assert all(c.shape == (5, 2, 8, 2, 16) and c.dtype == torch.bfloat16 for c in caches)
    assert all(not c.any() for c in caches)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """(HF's dequantization of the default GGUF, our load of it); HF takes ~15 s to load."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(None)
    hf = AutoModelForCausalLM.from_pretrained(
        loaded.path.parent, gguf_file=loaded.path.name, dtype=torch.float32
    ).eval()
    return hf, loaded


def smollm2_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    random_ids = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (21, 58)]
    # A repeated phrase: induction heads attend sharply to the earlier copy.
    phrase = torch.randint(0, 49152, (9,), generator=gen).tolist()
    return [*random_ids, [1, *phrase, *phrase, *phrase, *phrase[:5]]]


@pytest.mark.slow
def test_smollm2_gguf_prefill_matches_transformers(smollm2: Any) -> None:
    hf, loaded = smollm2
    prompts = smollm2_prompts()
    tables = [[0, 1], [2, 3, 4, 5], [6, 7, 8]]
    cache = loaded.model.allocate_kv_cache(num_blocks=10, block_size=BLOCK_SIZE)
    chunks = [Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for ours, tokens in zip(paged_forward(loaded.model, cache, chunks), prompts, strict=True):
        assert_close_logits(ours, hf_logits(hf, tokens))


@pytest.mark.slow
def test_smollm2_greedy_decode_on_paged_cache_matches_transformers(smollm2: Any) -> None:
    hf, loaded = smollm2
    tokens, table = smollm2_prompts()[2], [5, 0, 3]
    cache = loaded.model.allocate_kv_cache(num_blocks=6, block_size=BLOCK_SIZE)
    outs = paged_forward(loaded.model, cache, [Chunk(tokens, 0, table)])
    for _ in range(5):
        tokens = [*tokens, int(outs[-1][-1].argmax())]
        outs += paged_forward(loaded.model, cache, [Chunk(tokens[-1:], len(tokens) - 1, table)])
    # The last token's logits are not in HF's run over `tokens`; everything before must match.
    assert_close_logits(torch.cat(outs)[:-1], hf_logits(hf, tokens)[:-1])
