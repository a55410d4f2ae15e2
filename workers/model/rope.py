"""Rotary position embeddings, rotate-half (GPT-NeoX) style as in Hugging Face Llama.

The inverse frequencies follow transformers' `modeling_rope_utils` for the default, linear,
llama3 and yarn variants, so our logits match HF's. cos/sin are tabulated once for every position
up to `max_position_embeddings`; a forward pass gathers its rows by position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from workers.model.config import ModelConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # int64 arange then float, exactly as HF does, so the frequencies agree to the last bit.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(theta: float, dim: int, params: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, and scale attention (mscale)."""
    factor = params["factor"]
    original_len = params["original_max_position_embeddings"]

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[head_dim / 2]` float32, factor applied to cos and sin)."""
    dim, theta, params = config.head_dim, config.rope_theta, config.rope_scaling
    rope_type = config.rope_type
    inv_freq = _default_inv_freq(theta, dim)
    if params is None or rope_type == "dynamic":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(theta, dim, params)
    raise AssertionError(f"rope_type {rope_type!r} passed validation but has no implementation")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables `[max_position_embeddings, head_dim / 2]`, looked up by position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        """`freq_factors` divide the frequencies (llama.cpp's `rope_freqs` tensor for Llama 3)."""
        super().__init__()
        inv_freq, scale = rope_inv_freq(config)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float().cpu()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Computed in float32 then cast, as HF does, so bf16 tables round the same way.
        self.register_buffer("cos", (freqs.cos() * scale).to(device, dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device, dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim / 2]` for `positions [T]`, broadcastable over heads."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` by rotate-half RoPE; returns a new contiguous tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
