"""Multi-item scoring: a shared prefix and its items as ONE logical request (research notes §5.3).

A group of consecutive requests `[prefix | item_0]`, `[prefix | item_1]`, ... becomes the logical
sequence `[prefix | item_0 | item_1 | ...]`; the kernel's mask lets each item token see the
prefix and its own item causally, never another item. FlashInfer's kMultiItemScoring describes
the mask with three small tensors (`prefix_len_ptr`, `token_pos_in_items_ptr`,
`max_item_len_ptr`) instead of a Q x K bit mask.

The logical sequence is not a valid paged sequence (an item's last page may be partial and the
next item starts on a fresh page), so its keys and values are addressed by a flat list of cache
slots, `page * page_size + offset`: FlashInfer's equivalent is the ragged prefill wrapper fed
with K/V gathered from those slots. RoPE positions are the model's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.attention.cascade import check_groups
from workers.attention.ops import attend


@dataclass(frozen=True)
class LogicalBatch:
    """Logical requests whose K/V are read slot by slot from a paged cache.

    Logical request g owns query rows `qo_indptr[g]:qo_indptr[g+1]` of the batch's q (its
    members' rows, contiguous since members are) and the keys at slots
    `kv_slots[kv_indptr[g]:kv_indptr[g+1]]`, in logical order. Its queries are the last `qo_len`
    of its `kv_len` logical positions.
    """

    qo_indptr: torch.Tensor  # int32 [G+1]
    kv_indptr: torch.Tensor  # int32 [G+1]
    kv_slots: torch.Tensor  # int64 [nnz_kv]
    qo_lens: tuple[int, ...]  # host copies
    kv_lens: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.qo_lens)


@dataclass(frozen=True)
class MultiItemLayout:
    """A `LogicalBatch` plus FlashInfer's multi-item scoring metadata, one entry per group.

    `token_pos_in_items_ptr[g * token_pos_in_items_len + k]` is the 1-based position within its
    item of logical position `prefix_len + k` (0 for a delimiter, and as padding).
    """

    logical: LogicalBatch
    prefix_len_ptr: torch.Tensor  # uint32 [G]
    token_pos_in_items_ptr: torch.Tensor  # uint16 [G * token_pos_in_items_len]
    token_pos_in_items_len: int
    max_item_len_ptr: torch.Tensor  # uint16 [G]
    prefix_lens: tuple[int, ...]  # host copies
    item_lens: tuple[tuple[int, ...], ...]  # per group, per member (member 0's may be 0)

    def token_pos_in_items(self, g: int) -> torch.Tensor:
        """Group g's slice of `token_pos_in_items_ptr`, as int64 `[kv_len - prefix_len]`."""
        start = g * self.token_pos_in_items_len
        length = self.logical.kv_lens[g] - self.prefix_lens[g]
        return self.token_pos_in_items_ptr[start : start + length].long()


def _slots(table: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Cache slots of positions `start..end-1` of a request with page table `table`."""
    num_pages = -(-end // page_size)
    if len(table) < num_pages:
        raise ValueError(f"block table has {len(table)} pages, {num_pages} needed")
    positions = torch.arange(start, end)
    pages = torch.tensor(list(table[:num_pages]), dtype=torch.int64)
    return pages[positions // page_size] * page_size + positions % page_size


def _item_lens(
    group: Sequence[int], prefix_len: int, qo_lens: Sequence[int], kv_lens: Sequence[int]
) -> list[int]:
    """Each member's item length; ValueError unless every item token is a new query row."""
    first = group[0]
    if not 0 <= prefix_len <= kv_lens[first]:
        raise ValueError(f"prefix_len {prefix_len} outside request {first} ({kv_lens[first]})")
    lens = [kv_lens[first] - prefix_len]
    if qo_lens[first] < lens[0]:
        raise ValueError(f"request {first}: its item must be new tokens (qo_len >= item len)")
    for b in group[1:]:
        if qo_lens[b] != kv_lens[b] - prefix_len or qo_lens[b] < 1:
            raise ValueError(
                f"request {b}: qo_len must equal kv_len - prefix_len >= 1 (only its item is new)"
            )
        lens.append(qo_lens[b])
    return lens


def build_multi_item_layout(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    groups: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    device: torch.device | str = "cpu",
) -> MultiItemLayout:
    """One logical request per group of consecutive requests sharing `prefix_lens[g]` tokens.

    The first member supplies the prefix (cached or computed in this step) and its item; every
    other member brings only its item's tokens as query rows. A lone request with
    `prefix_len == kv_len` is plain causal attention. Items have no delimiters:
    `token_pos_in_items` runs `1..L` per item. Raises ValueError on bad groups or lengths.
    """
    if len(groups) != len(prefix_lens):
        raise ValueError("groups and prefix_lens must have one entry per group")
    check_groups(groups, len(qo_lens))
    item_lens = [
        _item_lens(g, p, qo_lens, kv_lens) for g, p in zip(groups, prefix_lens, strict=True)
    ]
    stride = max((sum(lens) for lens in item_lens), default=0)
    if max((max(lens) for lens in item_lens), default=0) >= 1 << 16:
        raise ValueError("an item is longer than uint16 token_pos_in_items can count")
    slots: list[torch.Tensor] = []
    positions = torch.zeros(len(groups) * stride, dtype=torch.int64)
    for g, (group, prefix_len, lens) in enumerate(zip(groups, prefix_lens, item_lens, strict=True)):
        first = group[0]
        slots.append(_slots(block_tables[first], 0, kv_lens[first], page_size))
        for b in group[1:]:
            slots.append(_slots(block_tables[b], prefix_len, kv_lens[b], page_size))
        within = [torch.arange(1, n + 1) for n in lens]
        offset = g * stride
        positions[offset : offset + sum(lens)] = torch.cat(within)
    logical_qo = [sum(qo_lens[b] for b in group) for group in groups]
    logical_kv = [p + sum(lens) for p, lens in zip(prefix_lens, item_lens, strict=True)]
    logical = LogicalBatch(
        qo_indptr=_indptr(logical_qo, device),
        kv_indptr=_indptr(logical_kv, device),
        kv_slots=torch.cat(slots).to(device),
        qo_lens=tuple(logical_qo),
        kv_lens=tuple(logical_kv),
    )
    return MultiItemLayout(
        logical=logical,
        prefix_len_ptr=torch.tensor(list(prefix_lens), dtype=torch.uint32, device=device),
        token_pos_in_items_ptr=positions.to(torch.uint16).to(device),
        token_pos_in_items_len=stride,
        max_item_len_ptr=torch.tensor(
            [max(lens) for lens in item_lens], dtype=torch.uint16, device=device
        ),
        prefix_lens=tuple(prefix_lens),
        item_lens=tuple(tuple(lens) for lens in item_lens),
    )


def _indptr(lens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def multi_item_visible(
    qo_len: int, kv_len: int, prefix_len: int, token_pos_in_items: torch.Tensor
) -> torch.Tensor:
    """The kMultiItemScoring mask of one logical request: bool `[qo_len, kv_len]`, True = seen.

    Query i sits at `pos = i + kv_len - qo_len` and sees key j iff `j <= pos` and (`pos <
    prefix_len` or `j < prefix_len` or `j > pos - t`), with `t = token_pos_in_items[pos -
    prefix_len]` (research notes §5.3): a prefix token is plain causal; an item token sees the
    prefix and the `t` tokens ending at itself; a delimiter (`t = 0`) sees only the prefix.
    """
    device = token_pos_in_items.device
    pos = torch.arange(qo_len, device=device) + (kv_len - qo_len)
    j = torch.arange(kv_len, device=device)
    # Keys after `after[i]` (besides the prefix) are visible to query i: everything for a prefix
    # query, the last t tokens ending at itself for an item query.
    after = torch.full_like(pos, -1)
    in_item = pos >= prefix_len
    after[in_item] = pos[in_item] - token_pos_in_items.long()[pos[in_item] - prefix_len]
    return (j[None] <= pos[:, None]) & ((j < prefix_len)[None] | (j[None] > after[:, None]))


def attend_logical(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    logical: LogicalBatch,
    visible: Callable[[int], torch.Tensor],
    *,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of each logical request's rows of `q [num_tokens, Hq, D]`.

    `visible(g)` gives request g's bool mask `[qo_len, kv_len]` (no causal rule is added).
    Returns `out [num_tokens, Hq, D]` in q's dtype and the base-2 LSE `[num_tokens, Hq]`.
    """
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    page_size = kv_cache.shape[2]
    qo_starts, kv_starts = logical.qo_indptr.tolist(), logical.kv_indptr.tolist()
    for g in range(logical.num_requests):
        slots = logical.kv_slots[kv_starts[g] : kv_starts[g + 1]]
        # One gather for keys and values: [kv_len, 2, Hk, D].
        kv = kv_cache[slots // page_size, :, slots % page_size]
        rows = slice(qo_starts[g], qo_starts[g + 1])
        out[rows], lse[rows] = attend(
            q[rows], kv[:, 0], kv[:, 1], sm_scale=sm_scale, mask=visible(g)
        )
    return out, lse


def multi_item_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: MultiItemLayout,
    *,
    sm_scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-item scoring attention in torch: `q [num_tokens, Hq, D]` -> `out` like q.

    Each logical request's mask is rebuilt from the three metadata tensors on every call, as the
    kernel does. Same return contract as `AttentionBackend.forward`. Reads only.
    """
    logical = layout.logical

    def visible(g: int) -> torch.Tensor:
        tpi = layout.token_pos_in_items(g)
        return multi_item_visible(
            logical.qo_lens[g], logical.kv_lens[g], layout.prefix_lens[g], tpi
        )

    out, lse = attend_logical(q, kv_cache, logical, visible, sm_scale=sm_scale)
    return (out, lse) if return_lse else out
