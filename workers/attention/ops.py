"""Attention of dense tensors in PyTorch, with FlashInfer's semantics (research notes §10).

Bottom-right causal masking, GQA (query head `h` uses KV head `h // (Hq // Hk)`), base-2 LSE, and
output 0 / LSE -inf for a row with no visible key. Every backend and every torch reference path
(multi-item scoring, custom masks, the fake FlashInfer of the tests) computes attention with these
functions once its keys and values are gathered out of the paged cache. On CPU an unmasked or
causal chunk runs on our prefill kernel (`prefill_attention.py`) where it builds and takes the
shapes, else on ATen's flash attention; masked attention runs on ATen's flash attention;
elsewhere plain float32 tensor ops. All functions are pure.
"""

from __future__ import annotations

import math

import torch

import workers.attention.prefill_attention as prefill_kernel
from workers.attention.merge import merge_state

_LOG2_E = 1.0 / math.log(2.0)
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in plain float32 tensor ops, for devices without the CPU flash kernel.

    Same contract as `attend_padded`; also the readable statement of what it computes.
    """
    batch, qo_len, num_qo_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_qo_heads // num_kv_heads
    # Query head h = kv_head * group + g, so this view puts each query head under its KV head.
    qg = q.float().reshape(batch, qo_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bmhgd,blhd->bhgml", qg, k.float()) * sm_scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # natural log, -inf for a row with no visible key
    # Subtracting 0 instead of -inf keeps exp() at 0 (not NaN) on empty rows, so their output is 0.
    probs = torch.exp(scores - torch.nan_to_num(lse, neginf=0.0)[..., None])
    out = torch.einsum("bhgml,blhd->bmhgd", probs, v.float())
    out = out.reshape(batch, qo_len, num_qo_heads, head_dim)
    lse2 = (lse * _LOG2_E).permute(0, 3, 1, 2).reshape(batch, qo_len, num_qo_heads)
    return out.to(q.dtype), lse2


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention over a batch of padded requests.

    `q [B, M, Hq, D]`, `k`/`v [B, L, Hk, D]`, `visible` bool broadcastable to `[B, M, L]`.
    Returns `out [B, M, Hq, D]` in q's dtype and the base-2 LSE `[B, M, Hq]` in float32, with
    output 0 and LSE -inf on rows with no visible key.
    """
    # The CPU flash kernel dies with SIGFPE on zero keys, so empty shapes take the dense path.
    if q.device.type != "cpu" or q.shape[1] == 0 or k.shape[1] == 0:
        return attend_dense(q, k, v, visible, sm_scale)
    # ATen's CPU flash kernel: GQA-aware, float accumulation for half dtypes, natural-log LSE;
    # about 3x faster than the dense path at SmolLM2's shapes.
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    out, lse = _flash_cpu(
        q.transpose(1, 2),
        k.to(q.dtype).transpose(1, 2),
        v.to(q.dtype).transpose(1, 2),
        attn_mask=bias[:, None],
        scale=sm_scale,
    )
    # On a fully masked row the kernel gives output 0 (as FlashInfer) but LSE 0, not -inf.
    empty = ~visible.any(dim=-1)  # [B, M or 1]
    lse2 = (lse.float() * _LOG2_E).transpose(1, 2).masked_fill(empty[..., None], float("-inf"))
    return out.transpose(1, 2), lse2


def causal_mask(qo_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bottom-right causal visibility `[qo_len, kv_len]`.

    Query i sees key j iff `j <= i + kv_len - qo_len`: the new tokens are the last of the sequence.
    """
    ones = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    return torch.tril(ones, diagonal=kv_len - qo_len)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request's queries `q [qo_len, Hq, D]` over `k`, `v [kv_len, Hk, D]`.

    `mask` (bool `[qo_len, kv_len]`, True = visible) and `causal` (bottom-right) both restrict
    which keys a query sees; with neither, every key is visible. Returns `out [qo_len, Hq, D]` in
    q's dtype and the base-2 LSE `[qo_len, Hq]` in float32; a row with no visible key gives output
    0 and LSE -inf. Pure: reads its inputs only.
    """
    qo_len, kv_len = q.shape[0], k.shape[0]
    if mask is None and q.device.type == "cpu" and 0 < qo_len <= kv_len:
        return _attend_unmasked(q, k, v, sm_scale, causal)
    visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device)
    if mask is not None:
        visible = visible & mask
    if causal:
        visible = visible & causal_mask(qo_len, kv_len, q.device)
    out, lse = attend_padded(q[None], k[None], v[None], visible[None], sm_scale)
    return out[0], lse[0]


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel without a mask tensor: `[L, H, D]` in, out and base-2 LSE out."""
    out, lse = _flash_cpu(
        q[None].transpose(1, 2),
        k.to(q.dtype)[None].transpose(1, 2),
        v.to(q.dtype)[None].transpose(1, 2),
        is_causal=is_causal,
        scale=sm_scale,
    )
    return out.transpose(1, 2)[0], (lse.float() * _LOG2_E).transpose(1, 2)[0]


def _attend_unmasked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain or bottom-right causal attention without materialising a mask.

    The kernel's own causal flag is top-left aligned, which equals bottom-right only for a
    square. So a chunk whose queries come after cached keys runs as two states merged by LSE:
    the cached keys, all visible, and the chunk's own square, causal. The kernel then skips the
    masked half of the square instead of scoring it against a dense bias (several times faster
    on long prefills).
    """
    if prefill_kernel.takes(q, k, v):
        # Bottom-right causal natively in one pass: 0.56 against ATen's 0.73 s on a 1,050-token
        # prefill's 30 layers (docs/benchmarks/step.md).
        return prefill_kernel.prefill_attention(q, k, v, sm_scale, causal)
    qo_len, kv_len = q.shape[0], k.shape[0]
    if not causal:
        return _flash(q, k, v, sm_scale, is_causal=False)
    if qo_len == kv_len:
        return _flash(q, k, v, sm_scale, is_causal=True)
    cached = kv_len - qo_len
    out_a, lse_a = _flash(q, k[:cached], v[:cached], sm_scale, is_causal=False)
    out_b, lse_b = _flash(q, k[cached:], v[cached:], sm_scale, is_causal=True)
    return merge_state(out_a, lse_a, out_b, lse_b)
