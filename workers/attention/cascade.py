"""Two-level cascade attention for requests that share leading KV pages (research notes §3.4).

Requests are partitioned into groups of consecutive requests. A group's members share their first
`shared_num_pages` full pages, and every member's query rows lie after those pages. Level 0 (the
shared level) lets all query rows of a group attend non-causally to the shared pages at once, so
the shared pages are read once per group instead of once per request; level 1 (the unique level)
lets each request attend causally to its own pages after the shared ones. The two partial states
merge by base-2 LSE into exactly the attention over the whole sequence.

The levels are two ordinary `BatchLayout`s run through any backend's plain paged attention (the
interface's default cascade, base.py), so a backend gets cascade by implementing plain paged
attention; FlashInfer's `MultiLevelCascadeAttentionWrapper` takes the same index tensors
(`qo_indptr_arr`, `kv_indptr_arr`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.attention.layout import BatchLayout
from workers.attention.merge import merge_state_in_place


@dataclass(frozen=True)
class CascadeLayout:
    """Both levels of a cascade step, built once per step and shared by every layer.

    `shared` holds one request per group with shared pages (query rows `shared_rows` of q, in
    order; KV = the shared pages, `kv_last_page_len = page_size`, non-causal); it is None when no
    group shares a page. `unique` holds one request per batch request (all query rows, KV = its
    pages after the shared ones, causal).
    """

    shared: BatchLayout | None
    unique: BatchLayout
    shared_rows: torch.Tensor  # int64 [num_shared_rows]: rows of q that take part in level 0
    shared_covers_all: bool  # every query row is in level 0, so no gather/scatter is needed
    groups: tuple[tuple[int, ...], ...]  # host copies of the builder's arguments
    shared_num_pages: tuple[int, ...]

    def shared_queries(self, q: torch.Tensor) -> torch.Tensor:
        """The rows of `q [num_tokens, Hq, D]` that attend to the shared level, in its order."""
        return q if self.shared_covers_all else q.index_select(0, self.shared_rows)

    @property
    def levels(self) -> tuple[BatchLayout, ...]:
        """The levels in FlashInfer's order: shared first (when present), unique last."""
        return (self.unique,) if self.shared is None else (self.shared, self.unique)

    @property
    def qo_indptr_arr(self) -> list[torch.Tensor]:
        return [level.qo_indptr for level in self.levels]

    @property
    def kv_indptr_arr(self) -> list[torch.Tensor]:
        return [level.kv_indptr for level in self.levels]

    @property
    def kv_indices_arr(self) -> list[torch.Tensor]:
        return [level.kv_indices for level in self.levels]

    @property
    def kv_last_page_len_arr(self) -> list[torch.Tensor]:
        return [level.kv_last_page_len for level in self.levels]


def check_groups(groups: Sequence[Sequence[int]], num_requests: int) -> None:
    """Raise ValueError unless `groups` lists requests 0..num_requests-1 in order, none empty.

    That is: the groups partition the batch and each group's members are contiguous in batch
    order, so a group's query rows are one contiguous run of q.
    """
    if any(len(g) == 0 for g in groups):
        raise ValueError("groups must not be empty")
    flat = [b for g in groups for b in g]
    if flat != list(range(num_requests)):
        raise ValueError(
            f"groups {[list(g) for g in groups]} must partition requests 0..{num_requests - 1} "
            "into runs of consecutive requests, in batch order"
        )


def _check_shared(
    group: Sequence[int],
    num_pages: int,
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
) -> None:
    """Raise ValueError unless the group's members really share `num_pages` leading pages."""
    if num_pages < 0:
        raise ValueError(f"shared_num_pages must be >= 0, got {num_pages}")
    if num_pages == 0:
        return
    shared_len = num_pages * page_size
    first = list(block_tables[group[0]][:num_pages])
    for b in group:
        if list(block_tables[b][:num_pages]) != first or len(first) < num_pages:
            raise ValueError(f"request {b} does not start with the group's {num_pages} pages")
        if kv_lens[b] - qo_lens[b] < shared_len or kv_lens[b] <= shared_len:
            raise ValueError(
                f"request {b} has query rows inside the shared prefix ({shared_len} tokens); "
                "a request that computes the prefix must be a group of its own with 0 pages"
            )


def _read_layout(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    page_size: int,
    causal: bool,
    device: torch.device | str,
) -> BatchLayout:
    """A layout that is only read through (no write slots): a few list ops, one tensor each.

    Unlike `build_layout` it allows `qo_len > kv_len`, which the non-causal shared level has
    whenever a group brings more query rows than the shared pages hold.
    """
    qo_indptr, kv_indptr = [0], [0]
    indices: list[int] = []
    last: list[int] = []
    for qo_len, kv_len, table in zip(qo_lens, kv_lens, tables, strict=True):
        num_pages = -(-kv_len // page_size)
        indices.extend(table[:num_pages])
        qo_indptr.append(qo_indptr[-1] + qo_len)
        kv_indptr.append(len(indices))
        last.append(kv_len - (num_pages - 1) * page_size)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return BatchLayout(
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(kv_indptr),
        kv_indices=i32(indices),
        kv_last_page_len=i32(last),
        write_slots=torch.zeros(0, dtype=torch.int64, device=device),
        page_size=page_size,
        qo_lens=tuple(qo_lens),
        kv_lens=tuple(kv_lens),
        causal=causal,
    )


def build_cascade_layout(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    groups: Sequence[Sequence[int]],
    shared_num_pages: Sequence[int],
    device: torch.device | str = "cpu",
) -> CascadeLayout:
    """Both cascade levels for requests as in `build_layout`, grouped by `groups`.

    Group g's members share their first `shared_num_pages[g]` pages (all full). Raises
    ValueError when the groups do not partition the batch into consecutive runs, when a member's
    table does not start with the group's shared pages or is too short, or when a member has
    query rows inside the shared prefix.
    """
    if len(groups) != len(shared_num_pages):
        raise ValueError("groups and shared_num_pages must have one entry per group")
    check_groups(groups, len(qo_lens))
    qo_starts = [0]
    for b, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens, strict=True)):
        if not 0 <= qo_len <= kv_len or len(block_tables[b]) < -(-kv_len // page_size):
            raise ValueError(f"request {b}: bad lengths or too short a block table")
        qo_starts.append(qo_starts[-1] + qo_len)
    shared_q: list[int] = []
    shared_tables: list[list[int]] = []
    rows: list[int] = []
    unique_kv: list[int] = []
    unique_tables: list[Sequence[int]] = []
    for group, num_pages in zip(groups, shared_num_pages, strict=True):
        _check_shared(group, num_pages, qo_lens, kv_lens, block_tables, page_size)
        for b in group:
            unique_kv.append(kv_lens[b] - num_pages * page_size)
            unique_tables.append(block_tables[b][num_pages:])
        if num_pages > 0:
            shared_q.append(sum(qo_lens[b] for b in group))
            shared_tables.append(list(block_tables[group[0]][:num_pages]))
            rows.extend(range(qo_starts[group[0]], qo_starts[group[-1] + 1]))
    shared = None
    if shared_tables:
        shared_kv = [len(t) * page_size for t in shared_tables]
        shared = _read_layout(shared_q, shared_kv, shared_tables, page_size, False, device)
    unique = _read_layout(qo_lens, unique_kv, unique_tables, page_size, True, device)
    return CascadeLayout(
        shared=shared,
        unique=unique,
        shared_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        shared_covers_all=len(rows) == qo_starts[-1],
        groups=tuple(tuple(g) for g in groups),
        shared_num_pages=tuple(shared_num_pages),
    )


def _common_pages(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common run of leading page ids."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def find_prefix_groups(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    min_shared_pages: int = 1,
) -> tuple[list[list[int]], list[int]]:
    """Group consecutive requests by their common leading pages; returns (groups, shared pages).

    Only pages wholly before a request's first query row can be shared (its cached prefix), so a
    request computing its prefix stays alone with 0 shared pages. A request joins the open group
    while the common run stays >= `min_shared_pages` and the page reads saved,
    `(members - 1) * shared_pages`, do not drop. The runner orders sharers next to each other.
    """
    if min_shared_pages < 1:
        raise ValueError(f"min_shared_pages must be >= 1, got {min_shared_pages}")
    groups: list[list[int]] = []
    shared: list[int] = []  # per group: its common run (a lone member's shareable pages)
    for b in range(len(qo_lens)):
        shareable = list(block_tables[b][: (kv_lens[b] - qo_lens[b]) // page_size])
        if groups:
            group, current = groups[-1], shared[-1]
            new = _common_pages(block_tables[group[0]][:current], shareable)
            if new >= min_shared_pages and len(group) * new >= (len(group) - 1) * current:
                group.append(b)
                shared[-1] = new
                continue
        groups.append([b])
        shared.append(len(shareable))
    # A group of one saves nothing: it runs level 1 only.
    return groups, [n if len(g) > 1 else 0 for g, n in zip(groups, shared, strict=True)]


def merge_shared_level(
    layout: CascadeLayout,
    out: torch.Tensor,
    lse: torch.Tensor,
    out_shared: torch.Tensor,
    lse_shared: torch.Tensor,
) -> None:
    """Merge the shared level's state into the unique level's `(out, lse)`, mutating both.

    `out`/`lse` cover every query row; `out_shared`/`lse_shared` cover `layout.shared_rows`, in
    the order `shared_queries` gave them.
    """
    if layout.shared_covers_all:
        merge_state_in_place(out, lse, out_shared, lse_shared)
        return
    rows = layout.shared_rows
    o_rows, s_rows = out.index_select(0, rows), lse.index_select(0, rows)
    merge_state_in_place(o_rows, s_rows, out_shared, lse_shared)
    out.index_copy_(0, rows, o_rows)
    lse.index_copy_(0, rows, s_rows)
