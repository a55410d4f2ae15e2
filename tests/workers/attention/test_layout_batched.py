"""build_layout's whole-batch index arithmetic against the request-by-request loop it replaced:
the same tensors for any batch (decodes, prefill chunks, empty queries, long tables)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.attention.layout import BatchLayout, build_layout


def reference_layout(
    qo_lens: Sequence[int], kv_lens: Sequence[int], tables: Sequence[Sequence[int]], page_size: int
) -> dict[str, list[int]]:
    """One request at a time, as build_layout did before it worked on the whole batch."""
    indices: list[int] = []
    indptr, last_lens, slots, qo_indptr = [0], [], [], [0]
    for qo_len, kv_len, table in zip(qo_lens, kv_lens, tables, strict=True):
        num_pages = -(-kv_len // page_size)
        pages = list(table[:num_pages])
        indices.extend(pages)
        indptr.append(len(indices))
        last_lens.append(kv_len - (num_pages - 1) * page_size)
        for pos in range(kv_len - qo_len, kv_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        qo_indptr.append(qo_indptr[-1] + qo_len)
    return {
        "qo_indptr": qo_indptr,
        "kv_indptr": indptr,
        "kv_indices": indices,
        "kv_last_page_len": last_lens,
        "write_slots": slots,
    }


def as_lists(layout: BatchLayout) -> dict[str, list[int]]:
    return {
        "qo_indptr": layout.qo_indptr.tolist(),
        "kv_indptr": layout.kv_indptr.tolist(),
        "kv_indices": layout.kv_indices.tolist(),
        "kv_last_page_len": layout.kv_last_page_len.tolist(),
        "write_slots": layout.write_slots.tolist(),
    }


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]], int]:
    page_size = draw(st.sampled_from([1, 2, 16]))
    decode_only = draw(st.booleans())
    n = draw(st.integers(0, 12))
    qo_lens, kv_lens, tables = [], [], []
    for _ in range(n):
        kv_len = draw(st.integers(1, 80))
        qo_len = 1 if decode_only else draw(st.integers(0, kv_len))
        spare = draw(st.integers(0, 3))  # tables may hold pages past the KV
        pages = -(-kv_len // page_size) + spare
        tables.append(draw(st.lists(st.integers(0, 500), min_size=pages, max_size=pages)))
        qo_lens.append(qo_len)
        kv_lens.append(kv_len)
    return qo_lens, kv_lens, tables, page_size


@settings(max_examples=300, deadline=None)
@given(batches())
def test_whole_batch_layout_equals_the_request_by_request_loop(
    batch: tuple[list[int], list[int], list[list[int]], int],
) -> None:
    qo_lens, kv_lens, tables, page_size = batch
    layout = build_layout(qo_lens, kv_lens, tables, page_size)
    assert as_lists(layout) == reference_layout(qo_lens, kv_lens, tables, page_size)
    assert layout.kv_indices.dtype == layout.qo_indptr.dtype == torch.int32
    assert layout.write_slots.dtype == torch.int64
    assert layout.qo_lens == tuple(qo_lens) and layout.kv_lens == tuple(kv_lens)


def test_a_zero_query_beside_a_two_token_chunk_is_not_taken_for_decodes() -> None:
    # Two requests, two new tokens in all: as many as requests, yet not one each.
    layout = build_layout([0, 2], [5, 3], [[4], [7]], 16)
    assert layout.write_slots.tolist() == [7 * 16 + 1, 7 * 16 + 2]


def test_tuple_tables_and_tensor_lengths_are_taken_as_well() -> None:
    layout = build_layout(torch.tensor([1, 1]), torch.tensor([17, 2]), [(3, 9), (5,)], 16)
    assert layout.kv_indices.tolist() == [3, 9, 5]
    assert layout.write_slots.tolist() == [9 * 16 + 0, 5 * 16 + 1]
    assert layout.qo_lens == (1, 1) and all(type(n) is int for n in layout.kv_lens)
