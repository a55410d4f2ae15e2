"""A tiny random Llama as a Hugging Face folder (config.json + model.safetensors, no tokenizer),
for benchmarks that measure routing and caching rather than model speed."""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_llama(
    folder: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write the model into `folder` (created if needed) and return it. Deterministic in
    `seed`, so every process that writes it gets the same weights and fingerprint."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    intermediate = hidden_size * 2
    head_dim = hidden_size // num_heads
    config = {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    shapes = {
        "self_attn.q_proj.weight": (num_heads * head_dim, hidden_size),
        "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden_size),
        "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden_size),
        "self_attn.o_proj.weight": (hidden_size, num_heads * head_dim),
        "mlp.gate_proj.weight": (intermediate, hidden_size),
        "mlp.up_proj.weight": (intermediate, hidden_size),
        "mlp.down_proj.weight": (hidden_size, intermediate),
    }
    tensors = {
        "model.embed_tokens.weight": randn(vocab_size, hidden_size),
        "model.norm.weight": torch.ones(hidden_size),
        "lm_head.weight": randn(vocab_size, hidden_size),
    }
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden_size)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden_size)
        for name, shape in shapes.items():
            tensors[prefix + name] = randn(*shape)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
