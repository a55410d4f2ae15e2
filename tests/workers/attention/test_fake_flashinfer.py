"""The fake `flashinfer` against FlashInfer's own examples and rules, not against our code.

Each case builds what FlashInfer's documentation says by hand (or the way FlashInfer's own test
builds its dense multi-item mask), so the fake the backend tests rely on is pinned to FlashInfer's
statements independently of `workers.attention`.
"""

from __future__ import annotations

import math

import fake_flashinfer
import pytest
import torch

FI = fake_flashinfer.make_module()


def _prefill(
    qo_lens: list[int],
    kv_lens: list[int],
    heads: tuple[int, int, int] = (1, 1, 8),
    **plan: object,
) -> fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper:
    """A prefill wrapper planned over one-token pages; `heads` = (qo heads, kv heads, dim)."""
    wrapper = FI.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(16, dtype=torch.uint8), "NHD")
    i32 = torch.int32
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=i32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=i32)
    indices = torch.arange(sum(kv_lens), dtype=i32)
    last = torch.ones(len(kv_lens), dtype=i32)
    wrapper.plan(qo_indptr, kv_indptr, indices, last, *heads, 1, **plan)
    return wrapper


def test_causal_is_aligned_to_the_bottom_right() -> None:
    """`causal=True` equals the docstring's `torch.tril(ones, diagonal=kv_len - qo_len)`."""
    wrapper = _prefill([3, 2], [7, 2], causal=True)
    assert torch.equal(wrapper.visible(0), torch.tril(torch.ones(3, 7).bool(), diagonal=4))
    assert torch.equal(wrapper.visible(1), torch.tril(torch.ones(2, 2).bool()))
    assert _prefill([3], [7], causal=False).visible(0).all()


def test_packed_mask_bits_are_little_endian_row_major() -> None:
    """Request 0's mask `[[1,0,1,1,0],[0,1,0,0,1]]` flattens to bits 1011 0010 01: little bit
    order packs them as bytes 0b01001101 = 77 and 0b10 = 2 (request 1's mask starts at byte 2)."""
    mask0 = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 1]]).bool()
    mask1 = torch.tensor([[0, 1, 1]]).bool()
    flat = torch.cat([mask0.flatten(), mask1.flatten()])
    wrapper = _prefill([2, 1], [5, 3], custom_mask=flat)
    assert wrapper._custom_mask_buf.tolist() == [77, 2, 6]
    assert wrapper._mask_indptr_buf.tolist() == [0, 2, 3]  # bytes, as segment_packbits gives
    assert torch.equal(wrapper.visible(0), mask0) and torch.equal(wrapper.visible(1), mask1)


def test_a_packed_mask_keeps_its_indptr_in_bits() -> None:
    """plan(packed_custom_mask=...) keeps mask_indptr = cumsum(qo_len * kv_len), in bits, while
    run() reads it as bytes: right for the first request, wrong for the next."""
    packed = torch.tensor([77, 2, 6], dtype=torch.uint8)
    wrapper = _prefill([2, 1], [5, 3], packed_custom_mask=packed)
    assert wrapper._mask_indptr_buf.tolist() == [0, 10, 13]
    with pytest.raises(IndexError):
        wrapper.visible(1)  # byte 10 of a 3-byte mask


def _dense_multi_item(prefix_len: int, token_pos: list[int], qo_len: int) -> torch.Tensor:
    """The docstring's sequence `prefix | D item | D item | ... | D` as a dense mask, built as
    FlashInfer's test builds it: an item token sees the prefix and its own item's tokens up to
    itself (items told apart by counting delimiters); a delimiter sees only the prefix; a
    prefix token is causal. Rows are the last `qo_len` positions."""
    kv_len = prefix_len + len(token_pos)
    kind = [-1] * prefix_len + token_pos  # -1 prefix, 0 delimiter, else position in its item
    item = torch.cumsum(torch.tensor([k == 0 for k in kind]), 0).tolist()
    mask = torch.zeros(kv_len, kv_len, dtype=torch.bool)
    for q in range(kv_len):
        for k in range(kv_len):
            if kind[q] == -1:
                mask[q, k] = k <= q
            else:
                in_item = kind[k] > 0 and item[k] == item[q] and k <= q and kind[q] > 0
                mask[q, k] = k < prefix_len or in_item
    return mask[kv_len - qo_len :]


@pytest.mark.parametrize("cached_prefix", [False, True])
def test_multi_item_follows_the_docstring_example(cached_prefix: bool) -> None:
    """Items of 3, 2 and 4 tokens: `token_pos_in_items = [0,1,2,3,0,1,2,0,1,2,3,4,0]`, padded to
    `token_pos_in_items_len = 20`, after a 6-token prefix in the query or in the KV cache."""
    token_pos = [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0]
    prefix_len, kv_len = 6, 6 + len(token_pos)
    qo_len = len(token_pos) if cached_prefix else kv_len
    padded = torch.tensor(token_pos + [0] * (20 - len(token_pos)), dtype=torch.uint16)
    wrapper = _prefill(
        [qo_len],
        [kv_len],
        causal=True,
        prefix_len_ptr=torch.tensor([prefix_len], dtype=torch.uint32),
        token_pos_in_items_ptr=padded,
        token_pos_in_items_len=20,
        max_item_len_ptr=torch.tensor([4], dtype=torch.uint16),
    )
    assert torch.equal(wrapper.visible(0), _dense_multi_item(prefix_len, token_pos, qo_len))


def test_multi_item_refuses_a_max_item_len_below_an_item() -> None:
    """The kernel skips keys further back than `max_item_len`: too small drops item keys."""
    token_pos = torch.tensor([1, 2, 3, 1, 2], dtype=torch.uint16)
    wrapper = _prefill(
        [5],
        [9],
        prefix_len_ptr=torch.tensor([4], dtype=torch.uint32),
        token_pos_in_items_ptr=token_pos,
        token_pos_in_items_len=5,
        max_item_len_ptr=torch.tensor([2], dtype=torch.uint16),
    )
    with pytest.raises(ValueError, match="max_item_len"):
        wrapper.visible(0)


def test_run_uses_sm_scale_gqa_and_a_base_2_lse() -> None:
    """Two query heads over one KV head (GQA), `sm_scale` applied to q.k, LSE = log2 sum exp."""
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]]).half()  # [1 token, 2 heads, D=2]
    k = torch.tensor([[1.0, 1.0], [0.0, -1.0]])
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    cache = torch.stack([k, v], dim=1)[:, :, None, None, :].half()  # [2 pages, 2, 1, 1, 2]
    wrapper = _prefill([1], [2], heads=(2, 1, 2), q_data_type=torch.float16, sm_scale=0.5)
    out, lse = wrapper.run(q, cache, return_lse=True)
    for h, scores in enumerate(([0.5, 0.0], [1.0, -1.0])):  # 0.5 * q_h . k_j
        weights = torch.softmax(torch.tensor(scores), 0)
        torch.testing.assert_close(out[0, h].float(), weights @ v, atol=1e-3, rtol=0)
        assert lse[0, h].item() == pytest.approx(math.log2(sum(math.exp(x) for x in scores)))
