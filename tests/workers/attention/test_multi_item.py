"""Multi-item scoring and custom masks against scoring each item as its own request."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workers.attention.custom_mask import (
    build_custom_mask_layout,
    custom_mask_attention,
    custom_mask_from_multi_item,
    pack_mask,
    unpack_mask,
)
from workers.attention.layout import build_layout
from workers.attention.multi_item import (
    build_multi_item_layout,
    multi_item_attention,
    multi_item_visible,
)
from workers.attention.torch_backend import TorchBackend

HEAD_DIM = 16
SEED_TABLES = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7]]


def test_seed_worked_example_metadata() -> None:
    # P=96, S0=S1=4, page 16, logical sequence [P | S0 | S1] computed in one step.
    layout = build_multi_item_layout([100, 4], [100, 100], SEED_TABLES, 16, [[0, 1]], [96])
    assert layout.prefix_len_ptr.tolist() == [96]
    assert layout.prefix_len_ptr.dtype == torch.uint32
    assert layout.token_pos_in_items_ptr.tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert layout.token_pos_in_items_ptr.dtype == torch.uint16
    assert layout.token_pos_in_items_len == 8
    assert layout.max_item_len_ptr.tolist() == [4]
    assert layout.logical.qo_indptr.tolist() == [0, 104]
    assert layout.logical.kv_indptr.tolist() == [0, 104]
    # The prefix and S0 from request 0's pages, then S1's four slots on page 7.
    want_slots = list(range(100)) + [7 * 16 + i for i in range(4)]
    assert layout.logical.kv_slots.tolist() == want_slots


def dense_item_reference(
    qo_len: int, kv_len: int, prefix_len: int, kinds: list[int]
) -> torch.Tensor:
    """The MIS mask written from item ids: `kinds[k]` is the item of position P+k, -1 a delimiter.

    A prefix query is causal; an item query sees the prefix and its own item up to itself; a
    delimiter query sees only the prefix (the kernel rule, research notes §5.3).
    """
    visible = torch.zeros(qo_len, kv_len, dtype=torch.bool)
    for i in range(qo_len):
        pos = i + kv_len - qo_len
        for j in range(pos + 1):
            if pos < prefix_len or j < prefix_len:
                visible[i, j] = True
            else:
                item_q, item_k = kinds[pos - prefix_len], kinds[j - prefix_len]
                visible[i, j] = item_q >= 0 and item_q == item_k
    return visible


@pytest.mark.parametrize("cached_prefix", [0, 3, 5])
def test_visible_rule_with_delimiters(cached_prefix: int) -> None:
    # prefix 5 | D | item 3 | D | item 2 | D | item 4 | D, as in the notes' example.
    tpi = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0], dtype=torch.uint16)
    kinds = [-1, 0, 0, 0, -1, 1, 1, -1, 2, 2, 2, 2, -1]
    kv_len = 5 + len(tpi)
    qo_len = kv_len - cached_prefix
    got = multi_item_visible(qo_len, kv_len, 5, tpi)
    assert torch.equal(got, dense_item_reference(qo_len, kv_len, 5, kinds))


def test_visible_rule_seed_example_blocks() -> None:
    tpi = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    visible = multi_item_visible(104, 104, 96, tpi)
    assert torch.equal(visible[:96, :96], torch.ones(96, 96, dtype=torch.bool).tril())
    assert not visible[:96, 96:].any()
    assert visible[96:, :96].all()
    assert torch.equal(visible[96:100, 96:100], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not visible[96:100, 100:].any() and not visible[100:, 96:100].any()


def random_items_case(rng: random.Random, page_size: int, cached: bool):
    """A prefix (maybe cached) and items with their own pages; the prefix's full pages shared."""
    prefix_len = rng.randint(1, 3 * page_size + 2)
    item_lens = [rng.randint(1, page_size + 3) for _ in range(rng.randint(1, 4))]
    shared = prefix_len // page_size
    tail = prefix_len - shared * page_size
    tables, next_page = [], shared
    for n in item_lens:
        own = -(-(tail + n) // page_size)
        tables.append(list(range(shared)) + list(range(next_page, next_page + own)))
        next_page += own
    kv_lens = [prefix_len + n for n in item_lens]
    qo_lens = list(item_lens)
    if not cached:
        qo_lens[0] += prefix_len
    return prefix_len, item_lens, tables, qo_lens, kv_lens, next_page


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2)])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_multi_item_equals_custom_mask_equals_items_alone(
    seed: int, page_size: int, heads: tuple[int, int], cached: bool
) -> None:
    rng = random.Random(seed)
    prefix_len, item_lens, tables, qo_lens, kv_lens, num_pages = random_items_case(
        rng, page_size, cached
    )
    gen = torch.Generator().manual_seed(seed)
    num_qo_heads, num_kv_heads = heads
    # Every copy of the prefix's partial last page must hold the same keys: write them all.
    cache = torch.randn(num_pages, 2, page_size, num_kv_heads, HEAD_DIM, generator=gen)
    prefix_kv = torch.randn(prefix_len, 2, num_kv_heads, HEAD_DIM, generator=gen)
    for table in tables:
        pos = torch.arange(prefix_len)
        cache[torch.tensor(table)[pos // page_size], :, pos % page_size] = prefix_kv
    q = torch.randn(sum(qo_lens), num_qo_heads, HEAD_DIM, generator=gen)
    groups = [list(range(len(item_lens)))]
    mi = build_multi_item_layout(qo_lens, kv_lens, tables, page_size, groups, [prefix_len])
    # Through the one entry point: the layout's type picks the kind.
    backend = TorchBackend()
    got_mi = backend.forward(q, cache, mi, sm_scale=0.3)
    got_cm = backend.forward(q, cache, custom_mask_from_multi_item(mi), sm_scale=0.3)
    # Reference: each item scored as its own request [prefix | item] over its own block table.
    plain = build_layout(qo_lens, kv_lens, tables, page_size)
    want = backend.forward(q, cache, plain, sm_scale=0.3)
    assert isinstance(got_mi, torch.Tensor) and isinstance(got_cm, torch.Tensor)
    torch.testing.assert_close(got_mi, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cm, got_mi, atol=1e-5, rtol=1e-5)


def test_several_logical_requests_and_a_plain_one() -> None:
    # Group [0, 1] share a 6-token prefix; request 2 alone is plain (prefix_len = kv_len).
    page_size = 4
    tables = [[0, 1, 2], [0, 3, 4], [5, 6]]
    qo_lens, kv_lens = [8, 3], [8, 9]
    mi = build_multi_item_layout(
        qo_lens + [5], kv_lens + [7], tables, page_size, [[0, 1], [2]], [6, 7]
    )
    assert mi.logical.qo_lens == (11, 5) and mi.logical.kv_lens == (11, 7)
    assert mi.item_lens == ((2, 3), (0,))
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(7, 2, page_size, 2, HEAD_DIM, generator=gen)
    cache[3, :, :2] = cache[1, :, :2]  # request 1's copy of the prefix's partial page
    q = torch.randn(16, 4, HEAD_DIM, generator=gen)
    got = multi_item_attention(q, cache, mi, sm_scale=0.3, return_lse=True)
    plain = build_layout([8, 3, 5], [8, 9, 7], tables, page_size)
    want = TorchBackend().forward(q, cache, plain, sm_scale=0.3, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pack_mask_little_bit_order() -> None:
    mask = torch.tensor([[True, False, False], [False, False, False], [False, False, True]])
    packed, indptr = pack_mask([mask, torch.ones(1, 2, dtype=torch.bool)])
    # Bit 0 of byte 0 is element (0, 0); element 8 = (2, 2) is bit 0 of byte 1.
    assert packed.tolist() == [0b00000001, 0b00000001, 0b00000011]
    assert indptr.tolist() == [0, 2, 3] and indptr.dtype == torch.int32
    assert packed[:2].tolist() == np.packbits(mask.flatten().numpy(), bitorder="little").tolist()


def test_pack_unpack_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 7), (1, 1), (5, 16), (9, 9)]
    masks = [torch.rand(s, generator=gen) < 0.5 for s in shapes]
    packed, indptr = pack_mask(masks)
    assert indptr.diff().tolist() == [-(-(a * b) // 8) for a, b in shapes]
    for got, want in zip(unpack_mask(packed, indptr, shapes), masks, strict=True):
        assert torch.equal(got, want)


def test_custom_mask_is_applied_without_causal_rule() -> None:
    # Only the last key visible to every query: the output is that key's value.
    mi = build_multi_item_layout([4], [4], [[0]], 4, [[0]], [4])
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[:, 3] = True
    layout = build_custom_mask_layout(mi.logical, [mask])
    cache = torch.randn(1, 2, 4, 2, HEAD_DIM)
    out = custom_mask_attention(torch.randn(4, 4, HEAD_DIM), cache, layout, sm_scale=0.3)
    assert isinstance(out, torch.Tensor)
    want = cache[0, 1, 3].repeat_interleave(2, dim=0).expand(4, 4, HEAD_DIM)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    ("qo_lens", "kv_lens", "groups", "prefix_lens", "match"),
    [
        ([100, 4], [100, 100], [[0, 1]], [96, 96], "one entry per group"),
        ([100, 4], [100, 100], [[1, 0]], [96], "partition"),
        ([100, 5], [100, 100], [[0, 1]], [96], "only its item is new"),
        ([2, 4], [100, 100], [[0, 1]], [96], "must be new tokens"),
        ([100, 4], [100, 100], [[0, 1]], [101], "outside request"),
        ([100, 4], [100, 140], [[0, 1]], [136], "outside request"),
    ],
)
def test_build_multi_item_layout_rejects(qo_lens, kv_lens, groups, prefix_lens, match) -> None:
    tables = [SEED_TABLES[0], SEED_TABLES[1] + [8, 9, 10]]
    with pytest.raises(ValueError, match=match):
        build_multi_item_layout(qo_lens, kv_lens, tables, 16, groups, prefix_lens)


def test_build_multi_item_layout_rejects_short_table() -> None:
    with pytest.raises(ValueError, match="pages"):
        build_multi_item_layout([100, 20], [100, 116], SEED_TABLES, 16, [[0, 1]], [96])


def test_custom_mask_layout_rejects_bad_shapes() -> None:
    mi = build_multi_item_layout([100, 4], [100, 100], SEED_TABLES, 16, [[0, 1]], [96])
    with pytest.raises(ValueError, match="expected"):
        build_custom_mask_layout(mi.logical, [torch.ones(104, 103, dtype=torch.bool)])
    with pytest.raises(ValueError, match="logical requests"):
        build_custom_mask_layout(mi.logical, [])
