"""The pure-PyTorch attention backend: FlashInfer's semantics on CPU (or any torch device).

It reads the same `BatchLayout` index tensors FlashInfer's `plan()` takes, gathers the pages, and
attends with `ops` (research notes §10). It is both the production CPU path and the oracle the
FlashInfer backend is tested against. It implements plain paged attention only; cascade,
multi-item scoring and custom masks take the interface's torch defaults.

Decode requests (one new token each) are gathered page by page into one padded batch and attended
in a single kernel call; prefill requests are attended one at a time, since their query lengths
differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention.base import Attention, AttentionBackend, AttentionLayout, kernel_layout
from workers.attention.layout import BatchLayout
from workers.attention.ops import attend, attend_padded


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

    def plan(self, layout: AttentionLayout) -> None:
        # Only plain paged attention has gather tables; a cascade's levels plan at first use.
        kind = kernel_layout(layout)
        if isinstance(kind, BatchLayout):
            self._planned = (kind, _build_plan(kind))

    def _plan_for(self, layout: BatchLayout) -> _Plan:
        # Identity, not equality: a layout holds tensors, and each step builds a fresh one.
        if self._planned is None or self._planned[0] is not layout:
            self._planned = (layout, _build_plan(layout))
        return self._planned[1]

    def _forward_paged(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        plan = self._plan_for(layout)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if plan.decode is not None:
            k, v = plan.decode.read(kv_cache)
            q_dec = q[plan.decode_rows][:, None]
            o, s = attend_padded(q_dec, k, v, plan.decode.visible[:, None], sm_scale)
            out[plan.decode_rows] = o[:, 0]
            lse[plan.decode_rows] = s[:, 0]
        for p in plan.prefills:
            k, v = p.gather.read(kv_cache)
            # Cutting the tail of the last page off also aligns the causal diagonal to kv_len.
            n = p.kv_len
            o, s = attend(q[p.rows], k[0, :n], v[0, :n], sm_scale=sm_scale, causal=layout.causal)
            out[p.rows], lse[p.rows] = o, s
        return (out, lse) if return_lse else out
