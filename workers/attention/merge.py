"""Merging partial attention states, with FlashInfer's base-2 LSE rules (research notes §4, §10.6).

An attention state over a key set is `(v, s)`: the softmax-weighted values `v [n, H, D]` and the
base-2 log-sum-exp `s [n, H]` of the scores. Two states over disjoint key sets merge into the state
over their union, which is how cascade attention and split-KV combine their pieces. A state over no
visible key is `(0, -inf)`, and merging it changes nothing; two such states merge to `(0, -inf)`.

All functions compute in float32, return `v` in the input's dtype and `s` in float32, and never
produce NaN from `-inf` LSEs.
"""

from __future__ import annotations

import torch


def _weights(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`2^(s - m)`, with 0 where both are -inf (their difference is NaN, the state is empty)."""
    return torch.exp2(torch.nan_to_num(s - m, nan=float("-inf")))


def _normalize(
    weighted_v: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide the weighted sum by the weight total `d`, giving 0 where no state had a key."""
    has_keys = d > 0
    safe_d = torch.where(has_keys, d, torch.ones_like(d))
    v = torch.where(has_keys[..., None], weighted_v / safe_d[..., None], 0.0)
    return v, m + torch.log2(d)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states `v [n, H, D]`, `s [n, H]` over disjoint key sets; returns a new state."""
    s_a, s_b = s_a.float(), s_b.float()
    m = torch.maximum(s_a, s_b)
    w_a, w_b = _weights(s_a, m), _weights(s_b, m)
    weighted = w_a[..., None] * v_a.float() + w_b[..., None] * v_b.float()
    v, s = _normalize(weighted, w_a + w_b, m)
    return v.to(v_a.dtype), s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge `(v_other, s_other)` into `(v, s)`, mutating `v` and `s`.

    `mask` (bool `[n]`) selects the rows to merge; rows where it is False keep their state, as in
    FlashInfer's `merge_state_in_place`.
    """
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    if mask is not None:
        merged_v = torch.where(mask[:, None, None], merged_v, v)
        merged_s = torch.where(mask[:, None], merged_s, s.float())
    v.copy_(merged_v)
    s.copy_(merged_s)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `num_states` states per row: `v [n, num_states, H, D]`, `s [n, num_states, H]`.

    Returns `(v [n, H, D], s [n, H])`; zero states give the empty state `(0, -inf)`.
    """
    n, num_states, num_heads, head_dim = v.shape
    if num_states == 0:
        empty_s = torch.full((n, num_heads), float("-inf"), dtype=torch.float32, device=v.device)
        return v.new_zeros((n, num_heads, head_dim)), empty_s
    s = s.float()
    m = s.max(dim=1).values
    w = _weights(s, m[:, None])
    weighted = (w[..., None] * v.float()).sum(dim=1)
    merged_v, merged_s = _normalize(weighted, w.sum(dim=1), m)
    return merged_v.to(v.dtype), merged_s
