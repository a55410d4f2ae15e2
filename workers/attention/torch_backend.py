"""The pure-PyTorch attention backend: FlashInfer's semantics on CPU (or any torch device).

It reads the same `BatchLayout` index tensors FlashInfer's `plan()` takes and reproduces research
notes §10: bottom-right causal masking, GQA (query head `h` uses KV head `h // (Hq // Hk)`), base-2
LSE, and output 0 / LSE -inf for a row with no visible key. It is both the production CPU path and
the oracle the FlashInfer backend is tested against.

Decode requests (one new token each) are gathered page by page into one padded batch and attended
in a single kernel call; prefill requests are attended one at a time, since their query lengths
differ. On CPU the kernel is ATen's flash attention; elsewhere plain float32 tensor ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.attention.base import AttentionBackend, register_backend
from workers.attention.layout import BatchLayout
from workers.attention.merge import merge_state

_LOG2_E = 1.0 / math.log(2.0)
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in plain float32 tensor ops, for devices without the CPU flash kernel.

    Same contract as `_attend_padded`; also the readable statement of what it computes.
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


def _attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention over a batch of padded requests.

    `q [B, M, Hq, D]`, `k`/`v [B, L, Hk, D]`, `visible` bool broadcastable to `[B, M, L]`.
    Returns `out [B, M, Hq, D]` in q's dtype and the base-2 LSE `[B, M, Hq]` in float32, with
    output 0 and LSE -inf on rows with no visible key.
    """
    # The CPU flash kernel dies with SIGFPE on zero keys, so empty shapes take the dense path.
    if q.device.type != "cpu" or q.shape[1] == 0 or k.shape[1] == 0:
        return _attend_dense(q, k, v, visible, sm_scale)
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
    out, lse = _attend_padded(q[None], k[None], v[None], visible[None], sm_scale)
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
    qo_len, kv_len = q.shape[0], k.shape[0]
    if not causal:
        return _flash(q, k, v, sm_scale, is_causal=False)
    if qo_len == kv_len:
        return _flash(q, k, v, sm_scale, is_causal=True)
    cached = kv_len - qo_len
    out_a, lse_a = _flash(q, k[:cached], v[:cached], sm_scale, is_causal=False)
    out_b, lse_b = _flash(q, k[cached:], v[cached:], sm_scale, is_causal=True)
    return merge_state(out_a, lse_a, out_b, lse_b)


@dataclass(frozen=True)
class _KVGather:
    """The cache pages of a group of requests, padded to the longest request's page count.

    `visible` marks each gathered position that lies within its request's KV length; the padding
    (tail of the last page, and whole padding pages) points at real pages only so that the gather
    stays in bounds.
    """

    pages: torch.Tensor  # int64 [n, max_pages]
    visible: torch.Tensor  # bool [n, max_pages * page_size]

    def read(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather keys and values `[n, max_pages * page_size, Hk, D]` from a paged cache."""
        # Whole pages at a time: one contiguous copy per page, several times faster than per slot.
        flat = self.pages.flatten()
        shape = (self.pages.shape[0], -1, *kv_cache.shape[3:])
        k = kv_cache[:, 0].index_select(0, flat).view(shape)
        v = kv_cache[:, 1].index_select(0, flat).view(shape)
        return k, v


def _gather_for(layout: BatchLayout, requests: list[int]) -> _KVGather:
    """The padded page table of `requests`, from the layout's index tensors.

    Each request's length comes from its page count and `kv_last_page_len`, as in FlashInfer's
    `get_seq_lens`; only the padded width comes from the host copy `kv_lens`, so no device sync.
    """
    device = layout.kv_indices.device
    rows = torch.tensor(requests, dtype=torch.int64, device=device)
    page_size = layout.page_size
    max_pages = max(-(-layout.kv_lens[b] // page_size) for b in requests)
    first_page = layout.kv_indptr[:-1].long()[rows]
    num_pages = layout.kv_indptr[1:].long()[rows] - first_page
    kv_len = (num_pages - 1).clamp(min=0) * page_size + layout.kv_last_page_len.long()[rows]
    page_pos = torch.arange(max_pages, device=device)
    # Padding pages repeat the request's first page, a valid index whatever its length.
    in_range = page_pos[None] < num_pages[:, None]
    pages = layout.kv_indices.long()[first_page[:, None] + torch.where(in_range, page_pos[None], 0)]
    position = torch.arange(max_pages * page_size, device=device)
    return _KVGather(pages=pages, visible=position[None] < kv_len[:, None])


@dataclass(frozen=True)
class _Prefill:
    """One request with several new tokens: its query rows and its pages."""

    rows: slice
    kv_len: int  # the host copy; build_layout makes it agree with kv_last_page_len
    gather: _KVGather


@dataclass(frozen=True)
class _Plan:
    """Per-layout gather tables, built once and reused by every layer's `forward`."""

    decode_rows: torch.Tensor  # int64 query rows of the one-token requests
    decode: _KVGather | None
    prefills: list[_Prefill]


def _build_plan(layout: BatchLayout) -> _Plan:
    """Split the batch into one padded decode group and per-request prefills."""
    starts = [0]
    for qo_len in layout.qo_lens:
        starts.append(starts[-1] + qo_len)
    decodes = [b for b, qo_len in enumerate(layout.qo_lens) if qo_len == 1]
    prefills = [
        _Prefill(slice(starts[b], starts[b + 1]), layout.kv_lens[b], _gather_for(layout, [b]))
        for b, qo_len in enumerate(layout.qo_lens)
        if qo_len > 1
    ]
    device = layout.kv_indices.device
    decode_rows = torch.tensor([starts[b] for b in decodes], dtype=torch.int64, device=device)
    return _Plan(
        decode_rows=decode_rows,
        decode=_gather_for(layout, decodes) if decodes else None,
        prefills=prefills,
    )


class TorchBackend(AttentionBackend):
    """Paged attention in plain PyTorch; `plan` caches the gather tables for the layers."""

    name = "torch"

    def __init__(self) -> None:
        self._planned: tuple[BatchLayout, _Plan] | None = None

    def plan(self, layout: BatchLayout) -> None:
        self._planned = (layout, _build_plan(layout))

    def _plan_for(self, layout: BatchLayout) -> _Plan:
        # Identity, not equality: a layout holds tensors, and each step builds a fresh one.
        if self._planned is None or self._planned[0] is not layout:
            self.plan(layout)
        assert self._planned is not None
        return self._planned[1]

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        *,
        sm_scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan_for(layout)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if plan.decode is not None:
            k, v = plan.decode.read(kv_cache)
            q_dec = q[plan.decode_rows][:, None]
            o, s = _attend_padded(q_dec, k, v, plan.decode.visible[:, None], sm_scale)
            out[plan.decode_rows] = o[:, 0]
            lse[plan.decode_rows] = s[:, 0]
        for p in plan.prefills:
            k, v = p.gather.read(kv_cache)
            # Cutting the tail of the last page off also aligns the causal diagonal to kv_len.
            n = p.kv_len
            o, s = attend(q[p.rows], k[0, :n], v[0, :n], sm_scale=sm_scale, causal=layout.causal)
            out[p.rows], lse[p.rows] = o, s
        return (out, lse) if return_lse else out


register_backend("torch", TorchBackend)
