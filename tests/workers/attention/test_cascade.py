"""Cascade attention: layouts (the seed's worked example), grouping, and equality with plain."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from workers.attention.cascade import (
    build_cascade_layout,
    check_groups,
    find_prefix_groups,
)
from workers.attention.layout import build_layout
from workers.attention.schemes import SchemeBackend
from workers.attention.torch_backend import TorchBackend

HEAD_DIM = 16


@dataclass(frozen=True)
class GroupedBatch:
    qo_lens: list[int]
    kv_lens: list[int]
    tables: list[list[int]]
    groups: list[list[int]]
    shared_num_pages: list[int]
    num_pages: int


def random_grouped_batch(rng: random.Random, page_size: int, decode: bool) -> GroupedBatch:
    """Groups of requests sharing 0-3 full pages, each with its own tail and queries after it."""
    batch = GroupedBatch([], [], [], [], [], 0)
    next_page = 0
    for _ in range(rng.randint(1, 4)):
        num_shared = rng.randint(0, 3)
        shared = list(range(next_page, next_page + num_shared))
        next_page += num_shared
        group = []
        for _ in range(rng.randint(1, 3) if num_shared else 1):
            own_len = rng.randint(1, 2 * page_size + 3)
            own_pages = -(-own_len // page_size)
            batch.tables.append(shared + list(range(next_page, next_page + own_pages)))
            next_page += own_pages
            batch.kv_lens.append(num_shared * page_size + own_len)
            batch.qo_lens.append(1 if decode else rng.randint(1, own_len))
            group.append(len(batch.qo_lens) - 1)
        batch.groups.append(group)
        batch.shared_num_pages.append(num_shared)
    return GroupedBatch(**{**batch.__dict__, "num_pages": next_page})


def plain_and_cascade(batch: GroupedBatch, page_size: int, heads: tuple[int, int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_qo_heads, num_kv_heads = heads
    cache = torch.randn(batch.num_pages, 2, page_size, num_kv_heads, HEAD_DIM, generator=gen)
    q = torch.randn(sum(batch.qo_lens), num_qo_heads, HEAD_DIM, generator=gen)
    plain = build_layout(batch.qo_lens, batch.kv_lens, batch.tables, page_size)
    want = TorchBackend().forward(q, cache, plain, sm_scale=0.25, return_lse=True)
    layout = build_cascade_layout(
        batch.qo_lens,
        batch.kv_lens,
        batch.tables,
        page_size,
        batch.groups,
        batch.shared_num_pages,
    )
    # One instance per level, as the engine runs it.
    backend = SchemeBackend(TorchBackend(), TorchBackend())
    got = backend.forward(q, cache, layout, sm_scale=0.25, return_lse=True)
    return want, got


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2)])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_cascade_equals_plain_paged_attention(
    seed: int, page_size: int, heads: tuple[int, int], decode: bool
) -> None:
    batch = random_grouped_batch(random.Random(seed), page_size, decode)
    (want_o, want_s), (got_o, got_s) = plain_and_cascade(batch, page_size, heads, seed)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


def test_decode_with_several_groups_equals_batch_decode() -> None:
    page_size = 4
    # Three groups sharing 5, 2 and 3 pages; every member decodes one token after its own tail.
    groups = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    shared_num_pages = [5, 2, 3]
    tables, kv_lens, next_page = [], [], 0
    for group, num_shared in zip(groups, shared_num_pages, strict=True):
        shared = list(range(next_page, next_page + num_shared))
        next_page += num_shared
        for b in group:
            own_len = 3 + 2 * b
            own_pages = -(-own_len // page_size)
            tables.append(shared + list(range(next_page, next_page + own_pages)))
            next_page += own_pages
            kv_lens.append(num_shared * page_size + own_len)
    batch = GroupedBatch([1] * 9, kv_lens, tables, groups, shared_num_pages, next_page)
    (want_o, want_s), (got_o, got_s) = plain_and_cascade(batch, page_size, (8, 2), seed=7)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


def test_one_backend_for_both_levels_gives_the_same() -> None:
    batch = random_grouped_batch(random.Random(3), 4, decode=False)
    (want_o, _), _ = plain_and_cascade(batch, 4, (4, 2), seed=3)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(batch.num_pages, 2, 4, 2, HEAD_DIM, generator=gen)
    q = torch.randn(sum(batch.qo_lens), 4, HEAD_DIM, generator=gen)
    layout = build_cascade_layout(
        batch.qo_lens, batch.kv_lens, batch.tables, 4, batch.groups, batch.shared_num_pages
    )
    backend = TorchBackend()
    for _ in range(2):  # the second pass re-plans both levels on the one instance
        got = backend.forward(q, cache, layout, sm_scale=0.25)
        torch.testing.assert_close(got, want_o, atol=1e-5, rtol=1e-5)


def test_seed_worked_example_layout() -> None:
    # P=96, S0=S1=4, page 16: prefix pages 0-5, suffixes on pages 6 and 7; both suffixes query.
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7]]
    layout = build_cascade_layout([4, 4], [100, 100], tables, 16, [[0, 1]], [6])
    assert [t.tolist() for t in layout.qo_indptr_arr] == [[0, 8], [0, 4, 8]]
    assert [t.tolist() for t in layout.kv_indptr_arr] == [[0, 6], [0, 1, 2]]
    assert [t.tolist() for t in layout.kv_indices_arr] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert [t.tolist() for t in layout.kv_last_page_len_arr] == [[16], [4, 4]]
    assert layout.shared is not None and not layout.shared.causal and layout.unique.causal
    assert layout.shared_covers_all


def test_request_computing_the_prefix_is_a_group_of_its_own() -> None:
    # Ragged in one step: request 0 computes P+S0, requests 1 and 2 only their suffixes.
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7], [0, 1, 2, 3, 4, 5, 8]]
    groups, shared = find_prefix_groups([100, 4, 4], [100, 100, 100], tables, 16)
    assert (groups, shared) == ([[0], [1, 2]], [0, 6])
    layout = build_cascade_layout([100, 4, 4], [100] * 3, tables, 16, groups, shared)
    assert layout.shared_rows.tolist() == list(range(100, 108))
    assert not layout.shared_covers_all


@pytest.mark.parametrize(
    ("tables", "qo_lens", "kv_lens", "want"),
    [
        # two prefixes, two groups
        ([[0, 1, 5], [0, 1, 6], [2, 3, 7], [2, 3, 8]], [1] * 4, [9] * 4,
         ([[0, 1], [2, 3]], [2, 2])),
        # the third shares one page: saved page reads (3-1)*1 >= (2-1)*2, so it joins
        ([[0, 1, 5], [0, 1, 6], [0, 9, 7]], [1] * 3, [9] * 3, ([[0, 1, 2]], [1])),
        # the fourth would cut 3 shared pages to 1: it starts its own group
        ([[0, 1, 2, 5], [0, 1, 2, 6], [0, 1, 2, 7], [0, 9, 9, 8]], [1] * 4, [13] * 4,
         ([[0, 1, 2], [3]], [3, 0])),
        # nothing in common
        ([[0, 1], [2, 3]], [1, 1], [5, 5], ([[0], [1]], [0, 0])),
        # queries reach into page 1: only page 0 is shareable
        ([[0, 1, 2], [0, 1, 3]], [5, 5], [9, 9], ([[0, 1]], [1])),
    ],
)  # fmt: skip
def test_find_prefix_groups(tables, qo_lens, kv_lens, want) -> None:
    assert find_prefix_groups(qo_lens, kv_lens, tables, 4) == want


def test_find_prefix_groups_min_shared_pages() -> None:
    tables = [[0, 5], [0, 6]]
    assert find_prefix_groups([1, 1], [5, 5], tables, 4) == ([[0, 1]], [1])
    assert find_prefix_groups([1, 1], [5, 5], tables, 4, min_shared_pages=2) == ([[0], [1]], [0, 0])
    with pytest.raises(ValueError, match="min_shared_pages"):
        find_prefix_groups([1, 1], [5, 5], tables, 4, min_shared_pages=0)


@pytest.mark.parametrize(
    ("groups", "shared", "qo_lens", "match"),
    [
        ([[0], [2], [1]], [0, 0, 0], [1, 1, 1], "partition"),
        ([[0, 1]], [0], [1, 1, 1], "partition"),
        ([[0, 1], []], [0, 0], [1, 1], "empty"),
        ([[0, 1, 2]], [1, 1], [1, 1, 1], "one entry per group"),
        ([[0, 1, 2]], [2], [1, 1, 1], "does not start with"),
        ([[0, 1, 2]], [1], [1, 6, 1], "inside the shared prefix"),
        ([[0, 1, 2]], [-1], [1, 1, 1], ">= 0"),
        ([[0], [1], [2]], [0, 0, 0], [1, 10, 1], "bad lengths"),
    ],
)
def test_build_cascade_layout_rejects(groups, shared, qo_lens, match) -> None:
    tables = [[0, 1, 2], [0, 3, 4], [0, 5, 6]]  # page 0 shared by all, page 1 by none
    with pytest.raises(ValueError, match=match):
        build_cascade_layout(qo_lens, [9, 9, 9], tables, 4, groups, shared)


def test_build_cascade_layout_rejects_short_table() -> None:
    with pytest.raises(ValueError, match="block table"):
        build_cascade_layout([1, 1], [9, 13], [[0, 1, 2], [0, 3, 4]], 4, [[0, 1]], [1])


def test_check_groups_accepts_a_partition_in_order() -> None:
    check_groups([[0, 1], [2], [3, 4]], 5)
