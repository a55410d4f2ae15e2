"""build_layout on hand-worked examples, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from workers.attention.layout import build_layout


def test_hand_worked_chunk_at_the_end_of_a_long_request() -> None:
    # kv_len 100 on pages of 16: 6 full pages + 4 tokens. The 4 new tokens (positions 96..99)
    # are offsets 0..3 of the 7th page, id 8, so slots 8*16 + 0..3. The 8th table entry is unused.
    table = [5, 3, 9, 0, 7, 2, 8, 11]
    layout = build_layout([4], [100], [table], 16)
    assert layout.kv_indices.tolist() == table[:7]
    assert layout.kv_indptr.tolist() == [0, 7]
    assert layout.kv_last_page_len.tolist() == [4]
    assert layout.qo_indptr.tolist() == [0, 4]
    assert layout.write_slots.tolist() == [128, 129, 130, 131]
    assert layout.kv_indptr.dtype == torch.int32 and layout.write_slots.dtype == torch.int64
    assert (layout.batch_size, layout.num_tokens, layout.kv_lens) == (1, 4, (100,))


def test_two_requests_with_new_tokens_straddling_a_page() -> None:
    # Request 0: kv_len 18, positions 14..17 -> page 4 offsets 14,15, then page 6 offsets 0,1.
    # Request 1: a decode at kv_len 32 -> full last page, slot 2*16 + 15.
    layout = build_layout([4, 1], [18, 32], [[4, 6], [1, 2]], 16, causal=False)
    assert layout.kv_indices.tolist() == [4, 6, 1, 2]
    assert layout.kv_indptr.tolist() == [0, 2, 4]
    assert layout.kv_last_page_len.tolist() == [2, 16]
    assert layout.qo_indptr.tolist() == [0, 4, 5]
    assert layout.write_slots.tolist() == [78, 79, 96, 97, 47]
    assert layout.causal is False


def test_page_size_one_puts_each_token_on_its_own_page() -> None:
    layout = build_layout([2], [3], [[7, 1, 4]], 1)
    assert layout.kv_last_page_len.tolist() == [1]
    assert layout.write_slots.tolist() == [1, 4]


@pytest.mark.parametrize(
    ("qo_lens", "kv_lens", "tables", "message"),
    [
        ([5], [4], [[0]], "bad lengths"),
        ([0], [0], [[0]], "bad lengths"),
        ([1], [17], [[0]], "1 pages, 2 needed"),
        ([1, 1], [3], [[0]], "one entry per request"),
    ],
)
def test_bad_inputs_raise(
    qo_lens: list[int], kv_lens: list[int], tables: list[list[int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_layout(qo_lens, kv_lens, tables, 16)
