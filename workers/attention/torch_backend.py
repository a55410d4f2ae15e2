"""The pure-PyTorch attention backend: FlashInfer's semantics on CPU (or any torch device).

It reads the same `BatchLayout` index tensors FlashInfer's `plan()` takes and attends with `ops`
(research notes §10). It is both the production CPU path and the oracle the FlashInfer backend is
tested against. It implements plain paged attention only; cascade, multi-item scoring and custom
masks take the interface's torch defaults.

Decode requests (one new token each) attend on CPU straight over their pages, through the
paged-decode kernel (`paged_decode.py`): the context's KV is read once per layer, not copied
first. Where the kernel cannot be built (no compiler), on other devices, or with
`decode_in_place=False`, they are gathered page by page into padded batches of similar lengths,
each attended in a single call. Prefill requests are attended one at a time, since their query
lengths differ: a prompt with no cached tokens over the keys/values `write_kv` was just given for
this layer (the same values the cache now holds), one with cached tokens over its pages gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from workers.attention.base import (
    Attention,
    AttentionBackend,
    AttentionLayout,
    StepLayout,
    kernel_layout,
)
from workers.attention.layout import BatchLayout
from workers.attention.ops import attend, attend_padded
from workers.attention.paged_decode import load as load_paged_decode
from workers.attention.paged_decode import paged_decode


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
class _Decodes:
    """One-token requests of similar lengths, gathered and attended together."""

    rows: torch.Tensor  # int64 query rows
    gather: _KVGather


@dataclass
class _Plan:
    """Per-layout tables, built once and reused by every layer's `forward`.

    The decode tables are built at first use: a step needs the kernel's table or the gather
    groups, not both.
    """

    layout: BatchLayout
    decode_batch: list[int]  # batch indexes of the one-token requests
    prefills: list[_Prefill]
    prefill_batch: list[int]  # batch indexes of the others, in the order of `prefills`
    _table: torch.Tensor | None = field(default=None, init=False)
    _groups: list[_Decodes] | None = field(default=None, init=False)

    def decode_table(self) -> torch.Tensor:
        """int64 `[n, 3]` for the kernel: each decode's query row, first page, KV length."""
        if self._table is None:
            # Whole columns of the layout (host copies, the kernel runs on CPU), not a row
            # built in Python per request.
            layout = self.layout
            rows = torch.tensor(self.decode_batch, dtype=torch.int64)
            columns = (
                layout.qo_indptr[:-1].cpu().long(),
                layout.kv_indptr[:-1].cpu().long(),
                torch.tensor(layout.kv_lens, dtype=torch.int64),
            )
            if len(self.decode_batch) == layout.batch_size:
                self._table = torch.stack(columns, dim=1)
            else:
                self._table = torch.stack([c[rows] for c in columns], dim=1)
        return self._table

    def rows_table(self) -> torch.Tensor:
        """int64 `[n, 4]` for the kernel over the several-token requests: each one's first
        query row, first page, KV length and number of query rows (all attending to all of
        its pages: the layout is not causal)."""
        layout, batch = self.layout, torch.tensor(self.prefill_batch, dtype=torch.int64)
        qo_starts = layout.qo_indptr.cpu().long()
        columns = (
            qo_starts[:-1][batch],
            layout.kv_indptr[:-1].cpu().long()[batch],
            torch.tensor(layout.kv_lens, dtype=torch.int64)[batch],
            (qo_starts[1:] - qo_starts[:-1])[batch],
        )
        return torch.stack(columns, dim=1)

    @property
    def decodes(self) -> list[_Decodes]:
        """The decodes in padded groups of similar lengths, for the gather path."""
        if self._groups is None:
            layout = self.layout
            device = layout.kv_indices.device
            starts = layout.qo_indptr.tolist()
            self._groups = [
                _Decodes(
                    torch.tensor([starts[b] for b in group], dtype=torch.int64, device=device),
                    _gather_for(layout, group),
                )
                for group in _decode_groups(layout, self.decode_batch)
            ]
        return self._groups


# A decode group pads every request to its longest: a request joins the group while its pages
# are at most this factor times the group's shortest (or `_GROUP_SLACK_PAGES` more), so padding
# at most doubles what is read. One long request among short ones (a handed-off prompt joining
# a decode batch) would otherwise make every request of the batch read its length.
_GROUP_FACTOR = 2
_GROUP_SLACK_PAGES = 8


def _decode_groups(layout: BatchLayout, decodes: list[int]) -> list[list[int]]:
    """`decodes` (batch indexes) split into groups of similar page counts."""
    pages = {b: -(-layout.kv_lens[b] // layout.page_size) for b in decodes}
    groups: list[list[int]] = []
    for b in sorted(decodes, key=pages.__getitem__):
        if groups:
            least = pages[groups[-1][0]]
            if pages[b] <= max(_GROUP_FACTOR * least, least + _GROUP_SLACK_PAGES):
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups


def _build_plan(layout: BatchLayout) -> _Plan:
    """Split the batch into decodes and per-request prefills."""
    starts = [0]
    for qo_len in layout.qo_lens:
        starts.append(starts[-1] + qo_len)
    prefills = [
        _Prefill(slice(starts[b], starts[b + 1]), layout.kv_lens[b], _gather_for(layout, [b]))
        for b, qo_len in enumerate(layout.qo_lens)
        if qo_len > 1
    ]
    decodes = [b for b, qo_len in enumerate(layout.qo_lens) if qo_len == 1]
    prefill_batch = [b for b, qo_len in enumerate(layout.qo_lens) if qo_len > 1]
    return _Plan(layout, decodes, prefills, prefill_batch)


def _kernel_fits(q: torch.Tensor, kv_cache: torch.Tensor, layout: BatchLayout) -> bool:
    """Whether the paged-decode kernel takes these tensors (it is built by then)."""
    return (
        q.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and q.dtype == kv_cache.dtype
        and q.stride(-1) == 1
        and kv_cache.stride(-1) == 1
        and layout.kv_indices.dtype == torch.int32
        and layout.kv_indices.is_contiguous()
        and layout.page_size <= 64
    )


class TorchBackend(AttentionBackend):
    """Paged attention in plain PyTorch, decode through the CPU kernel where it is built;
    `plan` caches the page tables for the layers.

    `decode_in_place=False` keeps decode on the gather path (the reference, and the baseline the
    step benchmark measures the kernel against).
    """

    name = "torch"

    def __init__(self, *, decode_in_place: bool = True) -> None:
        self._planned: tuple[BatchLayout, _Plan] | None = None
        # The last `write_kv`'s cache, layout, keys and values: the layer's own fresh rows.
        self._fresh: tuple[torch.Tensor, BatchLayout, Tensor, Tensor] | None = None
        self.decode_in_place = decode_in_place
        if decode_in_place:
            # Build (or load) the kernel now, while the engine starts, not inside the first
            # decode step: a worker compiling there looks busy and routing moves its prefixes.
            load_paged_decode()

    def write_kv(
        self, kv_cache: torch.Tensor, layout: BatchLayout | StepLayout, k: Tensor, v: Tensor
    ) -> None:
        super().write_kv(kv_cache, layout, k, v)
        # The rows as written: a step layout attending over another layout (a scheme's) does
        # not match it below, and gathers.
        batch = layout if isinstance(layout, BatchLayout) else layout.batch
        fits = k.dtype == v.dtype == kv_cache.dtype
        self._fresh = (kv_cache, batch, k, v) if fits else None

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
        if plan.decode_batch:
            self._decode(q, kv_cache, plan, sm_scale, out, lse)
        prefills = plan.prefills
        if prefills and not layout.causal and self._in_place(q, kv_cache, layout):
            # Several queries over the same pages, none masked (cascade's shared level: every
            # request of a group over the prefix): the kernel reads each page once for all of
            # them, in place, where the gather path copies them out first.
            paged_decode(q, kv_cache, layout.kv_indices, plan.rows_table(), sm_scale, out, lse)
            prefills = []
        fresh = self._fresh_rows(kv_cache, layout)
        for p in prefills:
            if fresh is not None and p.kv_len == p.rows.stop - p.rows.start:
                # No cached tokens: its keys are the rows just written, no pages to gather.
                k, v = fresh[0][p.rows], fresh[1][p.rows]
            else:
                gathered_k, gathered_v = self.read_pages(p.gather, kv_cache)
                # Cutting the tail of the last page off also aligns the causal diagonal.
                k, v = gathered_k[0, : p.kv_len], gathered_v[0, : p.kv_len]
            o, s = attend(q[p.rows], k, v, sm_scale=sm_scale, causal=layout.causal)
            out[p.rows], lse[p.rows] = o, s
        return (out, lse) if return_lse else out

    def _fresh_rows(
        self, kv_cache: torch.Tensor, layout: BatchLayout
    ) -> tuple[Tensor, Tensor] | None:
        """This layer's keys and values as `write_kv` took them, where it wrote this layout's
        rows into this cache (the model's order: write, then attend); else None."""
        fresh = self._fresh
        if fresh is None or fresh[0] is not kv_cache or fresh[1] is not layout:
            return None
        return fresh[2], fresh[3]

    def _in_place(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: BatchLayout) -> bool:
        """Whether the paged-decode kernel runs this layout's pages in place."""
        return self.decode_in_place and _kernel_fits(q, kv_cache, layout) and load_paged_decode()

    def read_pages(self, gather: _KVGather, kv_cache: torch.Tensor) -> tuple[Tensor, Tensor]:
        """The gather path's copy of a group's pages out of the cache: keys and values
        `[n, max_pages * page_size, Hk, D]`. A method of its own so that the step benchmark can
        time the copy apart from the attention over it."""
        return gather.read(kv_cache)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _Plan,
        sm_scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Attention of the one-token requests into their rows of `out` and `lse`."""
        if self._in_place(q, kv_cache, plan.layout):
            paged_decode(
                q, kv_cache, plan.layout.kv_indices, plan.decode_table(), sm_scale, out, lse
            )
            return
        for group in plan.decodes:
            k, v = self.read_pages(group.gather, kv_cache)
            q_dec = q[group.rows][:, None]
            o, s = attend_padded(q_dec, k, v, group.gather.visible[:, None], sm_scale)
            out[group.rows] = o[:, 0]
            lse[group.rows] = s[:, 0]
