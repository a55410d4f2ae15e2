"""Beam search bookkeeping: which beams continue, which hypotheses are finished.

Pure logic over log-probabilities; the engine owns the requests and their blocks. A beam is a
running request; continuing a beam with another token forks it (shared blocks, copied tail).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from cachesvc.kv.types import RequestId


@dataclass(frozen=True)
class Candidate:
    parent: int  # index into the group's live beams
    token_id: int
    cum_logprob: float


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty
    ended_by_eos: bool


_MAX_EXP = 709.0  # math.exp overflows just above 709.78


def length_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Hugging Face's length-normalised beam score, `cum_logprob / length ** length_penalty`.

    Computed in log space, `-exp(log(-cum_logprob) - length_penalty * log(length))`, so that no
    length and penalty overflows or divides by zero: a score past float's range saturates at
    -inf (or 0.0 below it), keeping the order of every score that is representable.
    """
    if cum_logprob == 0 or math.isnan(cum_logprob):
        return 0.0 if cum_logprob == 0 else -math.inf
    log_scale = math.log(abs(cum_logprob)) - length_penalty * math.log(max(length, 1))
    magnitude = math.inf if log_scale > _MAX_EXP else math.exp(log_scale)
    return math.copysign(magnitude, cum_logprob)


def expand(
    cum_logprobs: Sequence[float],
    logprobs: Sequence[torch.Tensor],
    width: int,
    eos_ids: Collection[int],
) -> tuple[list[Candidate], list[Candidate]]:
    """Choose the next `width` beams and the EOS-ended candidates ranked above them.

    Each beam proposes its `2 * width` best tokens (so `width` non-EOS continuations always
    exist). Returns (continuations, finished), both best first.
    """
    proposals: list[Candidate] = []
    for parent, (cum, lp) in enumerate(zip(cum_logprobs, logprobs, strict=True)):
        top = torch.topk(lp, min(2 * width, lp.shape[-1]))
        for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            proposals.append(Candidate(parent, int(token), cum + float(value)))
    proposals.sort(key=lambda c: c.cum_logprob, reverse=True)
    keep: list[Candidate] = []
    finished: list[Candidate] = []
    for rank, cand in enumerate(proposals):
        if len(keep) == width:
            break
        if cand.token_id in eos_ids:
            # As Hugging Face: an EOS below the top `width` does not end a hypothesis.
            if rank < width:
                finished.append(cand)
        else:
            keep.append(cand)
    return keep, finished


@dataclass
class BeamGroup:
    """One prompt's beam search: live beams (request ids) and finished hypotheses."""

    public_id: RequestId
    width: int
    length_penalty: float
    max_tokens: int
    beams: list[RequestId] = field(default_factory=list)
    cum_logprobs: list[float] = field(default_factory=list)
    pending: dict[RequestId, torch.Tensor] = field(default_factory=dict)  # logits this step
    finished: list[Hypothesis] = field(default_factory=list)

    def ready(self) -> bool:
        """Every live beam has its logits for this step."""
        return bool(self.beams) and all(b in self.pending for b in self.beams)

    def add_finished(self, token_ids: Sequence[int], cum: float, eos: bool) -> None:
        score = length_score(cum, len(token_ids), self.length_penalty)
        self.finished.append(Hypothesis(tuple(token_ids), cum, score, eos))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def done(self, output_len: int) -> bool:
        """Early stopping: `width` hypotheses ended, or the beams reached max_tokens."""
        return len(self.finished) >= self.width or output_len >= self.max_tokens
