"""Base-2 state merging: pieces of attention over disjoint keys merge into attention over all."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.attention.merge import merge_state, merge_state_in_place, merge_states
from workers.attention.ops import attend

NEG_INF = float("-inf")


def random_qkv(seed: int, qo_len: int = 5, kv_len: int = 24) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, 8, 16, generator=gen)
    k = torch.randn(kv_len, 2, 16, generator=gen)
    v = torch.randn(kv_len, 2, 16, generator=gen)
    return q, k, v


def test_merge_of_two_halves_equals_attention_over_all_keys() -> None:
    q, k, v = random_qkv(0)
    full_v, full_s = attend(q, k, v, sm_scale=0.25)
    v_a, s_a = attend(q, k[:10], v[:10], sm_scale=0.25)
    v_b, s_b = attend(q, k[10:], v[10:], sm_scale=0.25)
    merged_v, merged_s = merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(merged_v, full_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_s, full_s, atol=1e-5, rtol=1e-5)


def test_merge_with_the_empty_state() -> None:
    v = torch.randn(3, 2, 4)
    s = torch.randn(3, 2)
    empty_v, empty_s = torch.zeros(3, 2, 4), torch.full((3, 2), NEG_INF)
    # Adding nothing changes nothing, on either side.
    for merged_v, merged_s in (
        merge_state(v, s, empty_v, empty_s),
        merge_state(empty_v, empty_s, v, s),
    ):
        torch.testing.assert_close(merged_v, v)
        torch.testing.assert_close(merged_s, s)
    both_v, both_s = merge_state(empty_v, empty_s, empty_v, empty_s)
    assert (both_v == 0).all() and (both_s == NEG_INF).all()


def test_merge_weights_by_base_2_lse() -> None:
    # s differs by exactly 1 (base 2): weights 2/3 and 1/3, merged s = s_b + log2(3).
    v_a, v_b = torch.ones(1, 1, 2), torch.zeros(1, 1, 2)
    s_a, s_b = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    v, s = merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(v, torch.full((1, 1, 2), 2 / 3))
    torch.testing.assert_close(s, torch.tensor([[torch.log2(torch.tensor(3.0)).item()]]))


def test_merge_keeps_the_value_dtype() -> None:
    v = torch.randn(2, 2, 4).bfloat16()
    s = torch.randn(2, 2)
    merged_v, merged_s = merge_state(v, s, v, s)
    assert merged_v.dtype == torch.bfloat16 and merged_s.dtype == torch.float32
    torch.testing.assert_close(merged_s, s + 1.0)  # two equal states: s + log2(2)


def test_merge_state_in_place_mutates_only_masked_rows() -> None:
    q, k, v = random_qkv(1, qo_len=4)
    full_v, full_s = attend(q, k, v, sm_scale=0.25)
    out, lse = attend(q, k[:7], v[:7], sm_scale=0.25)
    before_v, before_s = out.clone(), lse.clone()
    other_v, other_s = attend(q, k[7:], v[7:], sm_scale=0.25)
    mask = torch.tensor([True, False, True, False])
    merge_state_in_place(out, lse, other_v, other_s, mask=mask)
    torch.testing.assert_close(out[mask], full_v[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[mask], full_s[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~mask], before_v[~mask]) and torch.equal(lse[~mask], before_s[~mask])


def test_merge_state_in_place_without_mask() -> None:
    q, k, v = random_qkv(2)
    full_v, full_s = attend(q, k, v, sm_scale=0.25)
    out, lse = attend(q, k[:3], v[:3], sm_scale=0.25)
    merge_state_in_place(out, lse, *attend(q, k[3:], v[3:], sm_scale=0.25))
    torch.testing.assert_close(out, full_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_s, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 24), max_size=4),
    seed=st.integers(0, 1000),
    causal=st.booleans(),
)
def test_merge_states_of_any_split_equals_attention_over_all(
    cuts: list[int], seed: int, causal: bool
) -> None:
    # Split the keys at arbitrary points (empty chunks included); under the causal rule a chunk
    # may be invisible to some queries, so rows of empty states are exercised too.
    q, k, v = random_qkv(seed)
    visible = torch.tril(torch.ones(5, 24, dtype=torch.bool), diagonal=19) if causal else None
    full_v, full_s = attend(q, k, v, sm_scale=0.25, mask=visible)
    bounds = [0, *sorted(cuts), 24]
    pieces = [
        attend(q, k[a:b], v[a:b], sm_scale=0.25, mask=None if visible is None else visible[:, a:b])
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    stacked_v = torch.stack([p[0] for p in pieces], dim=1)
    stacked_s = torch.stack([p[1] for p in pieces], dim=1)
    merged_v, merged_s = merge_states(stacked_v, stacked_s)
    torch.testing.assert_close(merged_v, full_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_s, full_s, atol=1e-5, rtol=1e-5)


def test_merge_states_of_only_empty_states() -> None:
    v, s = merge_states(torch.zeros(2, 3, 2, 4), torch.full((2, 3, 2), NEG_INF))
    assert (v == 0).all() and (s == NEG_INF).all()
    v, s = merge_states(torch.zeros(2, 0, 2, 4), torch.zeros(2, 0, 2))
    assert v.shape == (2, 2, 4) and (v == 0).all() and (s == NEG_INF).all()
