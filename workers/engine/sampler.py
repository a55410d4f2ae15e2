"""Turns logits into token ids: greedy, or temperature / top-k / top-p with per-request seeds."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from workers.kernels.linear import row_argmax
from workers.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of `logits` `[N, vocab]` (float32), as `sample_each`; raises the
    first row's error when any row raised."""
    tokens = sample_each(logits, params, generators)
    for token in tokens:
        if isinstance(token, Exception):
            raise token
    return tokens  # type: ignore[return-value]  # no row raised


def sample_each(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    argmax: Sequence[int] | None = None,
) -> list[int | Exception]:
    """One token id per row of `logits` `[N, vocab]` (float32), or the exception that row's
    sampling raised (the others sample as usual). Advances the generators. `argmax`: each
    row's `argmax_rows`, where the caller has it already (the model's LM head finds it).

    Greedy rows share one argmax; the rows that draw without a generator (no seed) draw
    together, in one batched filter-softmax-multinomial (should it raise, they draw again one
    by one, each error kept to its row); each seeded row draws from its own generator, so a
    seeded request samples the same tokens whatever else is in the batch. Any `p` that
    SamplingParams accepts keeps at least one token, so a draw's probabilities are never NaN
    for finite logits.
    """
    assert logits.shape[0] == len(params) == len(generators)
    tokens: list[int | Exception] = list(argmax_rows(logits) if argmax is None else argmax)
    rows = list(zip(params, generators, strict=True))
    together = [row for row, (p, gen) in enumerate(rows) if gen is None and not p.greedy]
    try:
        if together:
            probs = batch_probs(logits[together], [params[row] for row in together])
            for row, token in zip(
                together, torch.multinomial(probs, 1)[:, 0].tolist(), strict=True
            ):
                tokens[row] = token
        alone = [row for row, (p, gen) in enumerate(rows) if gen is not None and not p.greedy]
    except Exception:  # some row of the batched draw: each draws alone, to tell which
        alone = [row for row, (p, _) in enumerate(rows) if not p.greedy]
    for row in alone:
        try:
            tokens[row] = _sample_row(logits[row], params[row], generators[row])
        except Exception as exc:  # this row's alone
            tokens[row] = exc
    return tokens


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value, the first of equals (torch's `argmax`, which
    Hugging Face's greedy search takes), as `row_argmax` finds it."""
    return row_argmax(logits).tolist()  # type: ignore[no-any-return]


def token_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a request seeded with `seed`: a hash, so
    neighbouring seeds and indices give unrelated streams; the same in every process."""
    digest = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % 2**64, index))
    return digest & (2**63 - 1)


_FLOAT32_MAX = 3.4028234663852886e38


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(row_probs(logits, p), 1, generator=gen).item())


def row_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one row `[vocab]` draws from: temperature, then top-k, then top-p."""
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
    return torch.softmax(scaled, dim=-1)


def batch_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`row_probs` of every row of `logits` `[N, vocab]` at once: per-row temperature, top-k
    and top-p as tensors, so N draws cost a few batched ops, not N times as many small ones."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = torch.tensor([min(p.temperature, _FLOAT32_MAX) for p in params])
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: no top-k
    if any(top_k):
        k = torch.tensor(top_k)
        top = torch.topk(scaled, max(top_k), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
        scaled = scaled.masked_fill((scaled < kth) & (k > 0)[:, None], float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params])
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # As `_top_p_filter`, row by row; a row without top-p (1.0) drops nothing.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop_sorted &= (top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


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
