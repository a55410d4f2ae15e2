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
    request samples the same tokens whatever else is in the batch. Raises when any row does:
    `pick` row by row is the way to keep one row's failure its own.
    """
    assert logits.shape[0] == len(params) == len(generators)
    argmax = logits.argmax(dim=-1).tolist()
    return [
        pick(logits[row], p, gen, argmax[row])
        for row, (p, gen) in enumerate(zip(params, generators, strict=True))
    ]


def pick(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, argmax: int) -> int:
    """The token of one row `[vocab]`: `argmax` (the row's, computed for the whole batch at
    once) when `p` is greedy, else a draw. Any `p` that SamplingParams accepts keeps at least
    one token, so the draw's probabilities are never NaN for finite logits."""
    return int(argmax) if p.greedy else _sample_row(logits, p, gen)


def token_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a request seeded with `seed`: a hash, so
    neighbouring seeds and indices give unrelated streams; the same in every process."""
    digest = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % 2**64, index))
    return digest & (2**63 - 1)


_FLOAT32_MAX = 3.4028234663852886e38


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shifted so the largest logit is 0: a small temperature then gives -inf, never inf (whose
    # softmax is NaN); softmax is unchanged by the shift. The divisor stays a finite float32
    # (a huge temperature would be inf there, and -inf / inf is NaN); one below GREEDY_BELOW
    # never gets here, so it is never 0.
    logits = logits.float()
    scaled = (logits - logits.max()) / min(p.temperature, _FLOAT32_MAX)
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
    # A token is dropped when the mass before it already reaches top_p; the first always stays
    # (explicitly: a top_p that is 0 in float32 would drop it too, and softmax of no token is NaN).
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
