"""Turns logits into token ids: greedy, or temperature / top-k / top-p with per-request seeds."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from workers.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of `logits` `[N, vocab]` (float32). Advances the generators.

    Greedy rows share one argmax; each sampled row draws from its own generator, so a seeded
    request samples the same tokens whatever else is in the batch.
    """
    assert logits.shape[0] == len(params) == len(generators)
    out = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0:
            out[row] = _sample_row(logits[row], p, gen)
    return [int(t) for t in out]


def token_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a request seeded with `seed`: a hash, so
    neighbouring seeds and indices give unrelated streams; the same in every process."""
    digest = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % 2**64, index))
    return digest & (2**63 - 1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shifted so the largest logit is 0: a tiny temperature then gives -inf, never inf (whose
    # softmax is NaN); softmax is unchanged by the shift.
    logits = logits.float()
    scaled = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        scaled = _top_p_filter(scaled, p.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches `top_p`."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # A token is dropped when the mass before it already reaches top_p; the first always stays.
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
