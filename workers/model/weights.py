"""From a checkpoint's tensors (Hugging Face names) to `LlamaModel`'s fused state dict.

Both file formats present their tensors as a `WeightSource` under Hugging Face names
(`model.layers.{i}.self_attn.q_proj.weight`, ...), read lazily one tensor at a time, so peak memory
stays near one copy of the model. This module fuses q/k/v and gate/up, checks every shape, and
casts to the target dtype and device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.model.config import ModelConfig, ModelLoadError


@dataclass(frozen=True)
class WeightSource:
    """A checkpoint opened for reading: its config and a lazy tensor reader."""

    config: ModelConfig
    tensor_names: frozenset[str]  # Hugging Face names
    read: Callable[[str], torch.Tensor]  # one tensor by HF name, on CPU, any float dtype
    identity: bytes  # digest of the weights' identity, for the model fingerprint
    rope_freq_factors: torch.Tensor | None = None  # llama.cpp's Llama 3 `rope_freqs`


def build_state_dict(
    source: WeightSource, *, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The `LlamaModel` state dict; raises ModelLoadError on a missing or misshapen tensor."""
    config = source.config

    def take(name: str, *shape: int) -> torch.Tensor:
        if name not in source.tensor_names:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        tensor = source.read(name)
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}"
            )
        return tensor

    def put(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype).contiguous()

    vocab, hidden = config.vocab_size, config.hidden_size
    state = {
        "embed_tokens": put(take("model.embed_tokens.weight", vocab, hidden)),
        "norm": put(take("model.norm.weight", hidden)),
    }
    if not config.tie_word_embeddings:
        state["lm_head"] = put(take("lm_head.weight", vocab, hidden))
    for i in range(config.num_layers):
        for name, tensor in _layer_state(config, i, take).items():
            state[f"layers.{i}.{name}"] = put(tensor)
    return state


def _layer_state(
    config: ModelConfig, i: int, take: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One decoder layer's fused tensors, still in the checkpoint's dtype."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    sizes = {"q": q_size, "k": kv_size, "v": kv_size}
    state = {
        "input_norm": take(f"model.layers.{i}.input_layernorm.weight", hidden),
        "qkv_weight": torch.cat(
            [take(f"{attn}{p}_proj.weight", n, hidden) for p, n in sizes.items()]
        ),
        "o_weight": take(f"{attn}o_proj.weight", hidden, q_size),
        "post_attention_norm": take(f"model.layers.{i}.post_attention_layernorm.weight", hidden),
        "gate_up_weight": torch.cat(
            [
                take(f"{mlp}gate_proj.weight", inter, hidden),
                take(f"{mlp}up_proj.weight", inter, hidden),
            ]
        ),
        "down_weight": take(f"{mlp}down_proj.weight", hidden, inter),
    }
    if config.qkv_bias:
        state["qkv_bias"] = torch.cat([take(f"{attn}{p}_proj.bias", n) for p, n in sizes.items()])
    if config.o_bias:
        state["o_bias"] = take(f"{attn}o_proj.bias", hidden)
    return state
