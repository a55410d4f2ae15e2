"""FlashInfer-style index tensors for one forward pass over a batch.

One layout serves every backend: the torch backend reads the same `qo_indptr`, `kv_indptr`,
`kv_indices` and `kv_last_page_len` that FlashInfer's `plan()` takes, so the CPU suite tests the
layouts the GPU will use.

The paged KV cache of one layer is a tensor `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
(FlashInfer's NHD layout): `[:, 0]` holds keys, `[:, 1]` values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's new tokens sit in the flat query and in the paged cache.

    Request b owns query rows `qo_indptr[b]:qo_indptr[b+1]` and the pages
    `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, in sequence order. Its KV length (cached tokens
    plus the new ones) is `(num_pages - 1) * page_size + kv_last_page_len[b]`. The new tokens are
    the last `qo_len` of those `kv_len` positions, so causal masking is bottom-right aligned.
    """

    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [nnz_pages]
    kv_last_page_len: torch.Tensor  # int32 [B]
    write_slots: torch.Tensor  # int64 [num_new_tokens]: page * page_size + offset of each new token
    page_size: int
    qo_lens: tuple[int, ...]  # host copies, so the torch backend never syncs on a device tensor
    kv_lens: tuple[int, ...]
    causal: bool = True

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)


def build_layout(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    *,
    causal: bool = True,
    device: torch.device | str = "cpu",
) -> BatchLayout:
    """Build the index tensors for requests with `qo_lens` new tokens and `kv_lens` total tokens.

    `block_tables[b]` lists request b's page ids in order; only the first
    `ceil(kv_lens[b] / page_size)` are used. Raises ValueError when a table is too short or a
    request has more new tokens than KV positions.
    """
    if not (len(qo_lens) == len(kv_lens) == len(block_tables)):
        raise ValueError("qo_lens, kv_lens and block_tables must have one entry per request")
    indices: list[int] = []
    indptr = [0]
    last_lens: list[int] = []
    slots: list[torch.Tensor] = []
    for qo_len, kv_len, table in zip(qo_lens, kv_lens, block_tables, strict=True):
        if qo_len > kv_len or kv_len <= 0:
            raise ValueError(f"bad lengths qo_len={qo_len} kv_len={kv_len}")
        num_pages = -(-kv_len // page_size)
        if len(table) < num_pages:
            raise ValueError(f"block table has {len(table)} pages, {num_pages} needed")
        pages = list(table[:num_pages])
        indices.extend(pages)
        indptr.append(len(indices))
        last_lens.append(kv_len - (num_pages - 1) * page_size)
        positions = torch.arange(kv_len - qo_len, kv_len)
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // page_size]
        slots.append(page_ids * page_size + positions % page_size)
    qo_indptr = [0]
    for qo_len in qo_lens:
        qo_indptr.append(qo_indptr[-1] + qo_len)
    write_slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return BatchLayout(
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(indptr),
        kv_indices=i32(indices),
        kv_last_page_len=i32(last_lens),
        write_slots=write_slots.to(device),
        page_size=page_size,
        qo_lens=tuple(int(x) for x in qo_lens),
        kv_lens=tuple(int(x) for x in kv_lens),
        causal=causal,
    )
