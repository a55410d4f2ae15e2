"""Llama / Qwen2 / Mistral forward pass over a paged KV cache, on a flat ragged batch.

All requests' new tokens are concatenated in layout order into one `[T]` batch; matmuls run on
the whole batch and only attention looks at request boundaries, through the attention backend.
q/k/v and gate/up are stored fused so each is one matmul. Weights are created on the meta device,
without memory, and the loader assigns the real ones (`load_state_dict(..., assign=True)`).
The matmuls run on the packed-panel CPU kernel (`workers.kernels.linear`) where `native_linear`
is on, as it is by default on CPUs with AVX-512: the loader packs each weight once
(`pack_weights`), a copy the weight's size.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.base import AttentionBackend
from workers.attention.layout import BatchLayout
from workers.kernels.host_tensor import host_zeros
from workers.kernels.linear import PackedWeights, linear, linear_argmax, native_by_default
from workers.kernels.linear import load as load_linear_kernel
from workers.model.config import ModelConfig
from workers.model.layer_ops import LayerOps
from workers.model.rope import RotaryEmbedding


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # A placeholder: allocating (let alone initialising) weights the loader replaces would
    # double peak memory on the device.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            head_dim,
        )
        self.eps = config.rms_norm_eps
        self.sm_scale = head_dim**-0.5
        # Rows of the fused projection: q heads, then k heads, then v heads.
        self.qk_size = (config.num_heads + config.num_kv_heads) * head_dim
        qkv_size = self.qk_size + config.num_kv_heads * head_dim
        weight = partial(_weight, dtype=dtype)
        self.input_norm = weight(hidden)
        self.qkv_weight = weight(qkv_size, hidden)
        self.qkv_bias = weight(qkv_size) if config.qkv_bias else None
        self.o_weight = weight(hidden, config.num_heads * head_dim)
        self.o_bias = weight(hidden) if config.o_bias else None
        self.post_attention_norm = weight(hidden)
        # Rows: gate, then up.
        self.gate_up_weight = weight(2 * config.intermediate_size, hidden)
        self.down_weight = weight(hidden, config.intermediate_size)
        # The weights' packed copies while the model's `native_linear` is on (it sets them).
        self.packs: PackedWeights | None = None
        # The elementwise steps, on the CPU kernel while the model's `native_elementwise` is on.
        self.ops = LayerOps(native=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` in and out; writes this layer's new keys/values."""
        ops = self.ops
        normed = ops.rms_norm(x, self.input_norm, self.eps)
        attended = self._attention(normed, cos, sin, kv_cache, layout, backend)
        # x is this layer's own: the embedding's or the last layer's fresh output.
        normed = ops.add_rms_norm_(x, attended, self.post_attention_norm, self.eps)
        return self._mlp(normed).add_(x)

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = x.shape[0], self.num_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, packs=self.packs, name="qkv")
        # One RoPE call rotates the q and k heads together.
        qk = self.ops.rope_qk(qkv, cos, sin, num_heads + self.num_kv_heads, head_dim)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, head_dim)
        backend.write_kv(kv_cache, layout, k, v)
        out = cast(torch.Tensor, backend.forward(q, kv_cache, layout, sm_scale=self.sm_scale))
        out = out.reshape(num_tokens, num_heads * head_dim)
        return linear(out, self.o_weight, self.o_bias, packs=self.packs, name="o")

    def pack_weights(self) -> None:
        """Pack the layer's matmul weights now, where `packs` is set."""
        if self.packs is not None:
            for name, weight in (
                ("qkv", self.qkv_weight),
                ("o", self.o_weight),
                ("gate_up", self.gate_up_weight),
                ("down", self.down_weight),
            ):
                self.packs.of(name, weight)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        packs = self.packs
        gate_up = linear(x, self.gate_up_weight, None, packs=packs, name="gate_up")
        return linear(self.ops.silu_mul(gate_up), self.down_weight, None, packs=packs, name="down")


class LlamaModel(nn.Module):
    """A Llama-family causal LM. Inference only; parameters never require grad.

    Built with placeholder (meta) weights and real RoPE tables on `device`; usable once the
    loader has assigned every weight. State-dict names: `embed_tokens`, `layers.{i}.{input_norm,
    qkv_weight, qkv_bias, o_weight, o_bias, post_attention_norm, gate_up_weight, down_weight}`,
    `norm`, `lm_head` (absent when the embeddings are tied).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        weight = partial(_weight, dtype=dtype)
        self.embed_tokens = weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype) for _ in range(config.num_layers)
        )
        self.norm = weight(config.hidden_size)
        self.lm_head = (
            None if config.tie_word_embeddings else weight(config.vocab_size, config.hidden_size)
        )
        self.rotary = RotaryEmbedding(
            config, dtype=dtype, device=device, freq_factors=rope_freq_factors
        )
        self._packs: PackedWeights | None = None
        self.native_linear = native_by_default(device)
        self.native_elementwise = native_by_default(device)

    @property
    def native_linear(self) -> bool:
        """Whether the matmuls run on the packed-panel CPU kernel (where it builds; else on
        `F.linear`). Settable, e.g. by a bench's A/B; off drops the packed copies."""
        return self._packs is not None

    @native_linear.setter
    def native_linear(self, on: bool) -> None:
        if on == self.native_linear:
            return
        self._packs = PackedWeights() if on else None
        for layer in self.layers:
            cast(DecoderLayer, layer).packs = PackedWeights() if on else None

    @property
    def native_elementwise(self) -> bool:
        """Whether the layers' norms, RoPE and SwiGLU run on the fused CPU kernels (where they
        build; else on torch's ops). Settable, e.g. by a bench's A/B."""
        return self._ops.native

    @native_elementwise.setter
    def native_elementwise(self, on: bool) -> None:
        self._ops = LayerOps(native=on)
        for layer in self.layers:
            cast(DecoderLayer, layer).ops = self._ops

    def pack_weights(self) -> None:
        """Pack every matmul's weight for the kernel now, where `native_linear` is on and the
        kernel builds, rather than in the first step (the loader calls it)."""
        if self._packs is None or not load_linear_kernel():
            return
        for layer in self.layers:
            cast(DecoderLayer, layer).pack_weights()
        self._packs.of("lm_head", self.lm_head_weight)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        layout: BatchLayout,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[N, vocab]` float32 of the rows `logits_indices` of the flat batch.

        `token_ids`, `positions` `[T]` int64, in layout order; `kv_caches` one tensor per layer
        (see `allocate_kv_cache`), mutated: the new tokens' keys/values are written at
        `layout.write_slots`. Does not call `backend.plan`; the backend plans per layout.
        `argmax_out` (int64 `[N]`, the logits' device), when given, gets each logits row's
        first largest index (greedy decoding's token): on CPU in float32 the LM head's kernel
        finds it as it computes the logits (`linear_argmax`).
        """
        num_tokens = token_ids.shape[0]
        # A scheme layout wraps the plain one; either way the plain one counts the new tokens.
        layout_tokens = getattr(layout, "batch", layout).num_tokens
        if positions.shape[0] != num_tokens or layout_tokens != num_tokens:
            raise ValueError(
                f"token_ids ({num_tokens}), positions ({positions.shape[0]}) and layout "
                f"({layout_tokens} tokens) must agree"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} kv caches, got {len(kv_caches)}")
        hidden = F.embedding(token_ids, self.embed_tokens)
        cos, sin = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, layout, backend)
        # Norm and LM head only for the rows that need logits: at decode the head dominates.
        hidden = hidden[logits_indices]
        hidden = self._ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        if argmax_out is not None:
            head = linear_argmax(
                hidden, self.lm_head_weight, argmax_out, packs=self._packs, name="lm_head"
            )
            return head.float()
        return linear(hidden, self.lm_head_weight, None, packs=self._packs, name="lm_head").float()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[torch.Tensor]:
        """Zeroed paged caches, one per layer, `[num_blocks, 2, block_size, kv_heads, head_dim]`.

        dtype and device default to the model's. The layers are consecutive slices of one
        `[layers, num_blocks, ...]` tensor, each contiguous: a block's KV across all layers then
        moves to and from the tiers in one strided copy instead of one copy per layer
        (`kv_copy.layered`).
        """
        config = self.config
        shape = (len(self.layers), num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
        dtype = dtype or self.embed_tokens.dtype
        device = torch.device(device or self.embed_tokens.device)
        if device.type == "cpu":
            return list(host_zeros(shape, dtype).unbind(0))
        return list(torch.zeros(shape, dtype=dtype, device=device).unbind(0))
