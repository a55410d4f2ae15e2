"""Custom-mask attention: an explicit bool mask per logical request (research notes §5.2).

The general form of multi-item scoring: each logical request carries a `[qo_len, kv_len]` bool
mask (True = visible), packed row-major into bits with little bit order and padded to a whole
byte per request, as FlashInfer's `packed_custom_mask` / `mask_indptr` (in bytes). No causal rule
is added. It can express any visibility (speculative-decoding trees), at the cost of storing and
reading the whole mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.multi_item import (
    LogicalBatch,
    MultiItemLayout,
    attend_logical,
    multi_item_visible,
)


def pack_mask(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack bool masks `[qo_len_b, kv_len_b]` into `(packed uint8 [nnz_bytes], mask_indptr)`.

    Request b's bits are `masks[b]` flattened row-major, little bit order
    (`numpy.packbits(bitorder="little")`), in bytes `mask_indptr[b]:mask_indptr[b+1]` (int32
    `[B+1]`). Both results are on the first mask's device (CPU when there is none).
    """
    device = masks[0].device if masks else torch.device("cpu")
    segments = [
        np.packbits(m.reshape(-1).cpu().numpy().astype(bool), bitorder="little") for m in masks
    ]
    indptr = np.cumsum([0] + [len(s) for s in segments])
    packed = np.concatenate(segments) if segments else np.zeros(0, dtype=np.uint8)
    return (
        torch.from_numpy(packed).to(device),
        torch.from_numpy(indptr.astype(np.int32)).to(device),
    )


def unpack_mask(
    packed: torch.Tensor, mask_indptr: torch.Tensor, shapes: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """Inverse of `pack_mask`: one bool mask of `shapes[b]` per request, on packed's device."""
    starts = mask_indptr.tolist()
    return [
        unpack_segment(packed[starts[b] : starts[b + 1]], qo_len, kv_len)
        for b, (qo_len, kv_len) in enumerate(shapes)
    ]


def unpack_segment(segment: torch.Tensor, qo_len: int, kv_len: int) -> torch.Tensor:
    """One request's packed bytes -> bool `[qo_len, kv_len]` (little bit order)."""
    bit = torch.arange(8, dtype=torch.uint8, device=segment.device)
    bits = (segment[:, None] >> bit) & 1
    return bits.reshape(-1)[: qo_len * kv_len].view(qo_len, kv_len).bool()


@dataclass(frozen=True)
class CustomMaskLayout:
    """A `LogicalBatch` and its packed masks (FlashInfer's `packed_custom_mask`, `mask_indptr`)."""

    logical: LogicalBatch
    packed_mask: torch.Tensor  # uint8 [nnz_bytes]
    mask_indptr: torch.Tensor  # int32 [G+1], in bytes


def build_custom_mask_layout(
    logical: LogicalBatch, masks: Sequence[torch.Tensor]
) -> CustomMaskLayout:
    """Pack one bool mask `[qo_len_g, kv_len_g]` per logical request; ValueError on a bad shape."""
    if len(masks) != logical.num_requests:
        raise ValueError(f"{len(masks)} masks for {logical.num_requests} logical requests")
    for g, m in enumerate(masks):
        if tuple(m.shape) != (logical.qo_lens[g], logical.kv_lens[g]):
            raise ValueError(
                f"mask {g} has shape {tuple(m.shape)}, "
                f"expected {(logical.qo_lens[g], logical.kv_lens[g])}"
            )
    packed, indptr = pack_mask(masks)
    device = logical.kv_slots.device
    return CustomMaskLayout(logical, packed.to(device), indptr.to(device))


def custom_mask_from_multi_item(layout: MultiItemLayout) -> CustomMaskLayout:
    """The same logical batch with the multi-item visibility written out as explicit masks."""
    logical = layout.logical
    masks = [
        multi_item_visible(
            logical.qo_lens[g],
            logical.kv_lens[g],
            layout.prefix_lens[g],
            layout.token_pos_in_items(g),
        )
        for g in range(logical.num_requests)
    ]
    return build_custom_mask_layout(logical, masks)


def custom_mask_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CustomMaskLayout,
    *,
    sm_scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q [num_tokens, Hq, D]` under the packed masks; output like q.

    The bits are unpacked on every call, as the kernel reads them. Same return contract as
    `AttentionBackend.forward`. Reads only.
    """
    logical = layout.logical
    starts = layout.mask_indptr.tolist()

    def visible(g: int) -> torch.Tensor:
        segment = layout.packed_mask[starts[g] : starts[g + 1]]
        return unpack_segment(segment, logical.qo_lens[g], logical.kv_lens[g])

    out, lse = attend_logical(q, kv_cache, logical, visible, sm_scale=sm_scale)
    return (out, lse) if return_lse else out
