"""A tiny random Llama-family model written as a Hugging Face folder, for fast tests and
benchmarks that measure serving and caching rather than the model.

The folder holds config.json and model.safetensors, and a tokenizer.json when asked: the same
layout `save_pretrained` writes, so both `load_model` and transformers open it. The weights are
drawn with torch alone (transformers is a test-only dependency), deterministic in `seed`: every
process that writes the same model gets the same bytes, hence the same fingerprint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.model.config import ARCHITECTURES

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

# Wider than transformers' 0.02: the greedy token after a 20-token prompt then depends on the
# prompt's first token about 3 times in 4 rather than 1 in 2, so a cache that serves wrong KV
# shows in the tokens; and the top two logits sit twice as far apart.
INIT_STD = 0.05
_CLASS_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


@dataclass(frozen=True)
class BpeTokenizer:
    """Byte-level BPE trained on `corpus` up to the model's vocabulary; `special` tokens take
    the first ids, and `eos` (one of them) ends a turn. Encodes any text."""

    corpus: Sequence[str]
    special: Sequence[str]
    eos: str

    def build(self, vocab_size: int) -> Tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(self.special),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(self.corpus, trainer)
        return tok


@dataclass(frozen=True)
class WordTokenizer:
    """One id per whitespace-separated word: `special` tokens first, then `words`, then `w0`,
    `w1`, ... up to the model's vocabulary, so that every id the model emits decodes to a word
    that encodes back to it. Unknown words become `unk` (one of `special`)."""

    words: Sequence[str]
    special: Sequence[str]
    unk: str
    eos: str

    def build(self, vocab_size: int) -> Tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        named = [*self.special, *self.words]
        vocab = [*named, *(f"w{i}" for i in range(vocab_size - len(named)))]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=self.unk))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(list(self.special))
        return tok


TinyTokenizer = BpeTokenizer | WordTokenizer


def write_tiny_model(
    folder: Path,
    *,
    architecture: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    tokenizer: TinyTokenizer | None = None,
) -> Path:
    """Write the model into `folder` (created if needed; files there are overwritten) and
    return `folder`. The MLP is twice as wide as `hidden_size`; bos is id 1, eos id 2. Qwen2
    gets random q/k/v biases, Mistral no sliding window. With `tokenizer`, tokenizer.json and
    tokenizer_config.json are written too; it must fit in `vocab_size`."""
    import torch
    from safetensors.torch import save_file

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    config = _config_json(
        architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _random_weights(config, torch.Generator().manual_seed(seed))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        _write_tokenizer(folder, tokenizer, vocab_size)
    return folder


def _config_json(architecture: str, **shape: Any) -> dict[str, Any]:
    """config.json as transformers writes it for `architecture`."""
    config = {
        "architectures": [f"{_CLASS_NAMES[architecture]}ForCausalLM"],
        "model_type": architecture,
        **shape,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if architecture != "llama":
        # Full attention: transformers would otherwise default Mistral to a 4096 window.
        config["sliding_window"] = None
    return config


def _random_weights(config: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name: N(0, INIT_STD) matrices and biases, unit
    norms. Drawn in a fixed order, so the same config and generator give the same weights."""
    import torch

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    vocab, hidden = config["vocab_size"], config["hidden_size"]
    inter = config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    tensors = {
        "model.embed_tokens.weight": randn(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(vocab, hidden)
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config["model_type"] == "qwen2":
        shapes |= {
            "self_attn.q_proj.bias": (q_size,),
            "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.bias": (kv_size,),
        }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, shape in shapes.items():
            tensors[prefix + name] = randn(*shape)
    return tensors


def _write_tokenizer(folder: Path, spec: TinyTokenizer, vocab_size: int) -> None:
    tok = spec.build(vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens, over {vocab_size}")
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": spec.eos, "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
