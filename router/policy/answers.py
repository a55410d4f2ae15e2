"""What the router knows of answers: the mean length and decode time of finished ones, and what
a request's own answer is expected to be (its `max_tokens` bounds it). Prefill/decode decisions
(`router.policy.pd.decide`) spread a stream's delays over them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The mean answer (tokens) before any request has finished, and how many answers it counts as:
# a chat turn's order of magnitude (the sample trace's is 149, MLPerf's Llama-3.1-8B server
# ~190), soon outweighed by what the router sees.
MEAN_ANSWER_PRIOR = 200.0
MEAN_ANSWER_PRIOR_WEIGHT = 20


class MeanAnswer:
    """The mean answer length (tokens) of finished requests, from `MEAN_ANSWER_PRIOR`, and
    their mean decode time (first token to last; nothing before one is seen); mutated by
    `observe`."""

    def __init__(self) -> None:
        self._total = MEAN_ANSWER_PRIOR * MEAN_ANSWER_PRIOR_WEIGHT
        self._count = MEAN_ANSWER_PRIOR_WEIGHT
        self._decode_total_s = 0.0
        self._decode_count = 0

    def observe(self, num_tokens: int, decode_s: float | None = None) -> None:
        self._total += num_tokens
        self._count += 1
        if decode_s is not None and decode_s >= 0:
            self._decode_total_s += decode_s
            self._decode_count += 1

    @property
    def tokens(self) -> float:
        return self._total / self._count

    @property
    def decode_s(self) -> float:
        """The mean seconds from an answer's first token to its last (0.0: none seen)."""
        return self._decode_total_s / self._decode_count if self._decode_count else 0.0


@dataclass(frozen=True)
class Answer:
    """What a decision knows of the request's answer: its expected length (tokens: the mean
    answer, or the request's `max_tokens` when that is fewer), the mean answer, and how long
    the mean answer takes to decode (seconds; 0.0 before one is seen)."""

    tokens: float
    mean_tokens: float
    mean_decode_s: float = 0.0

    @classmethod
    def of(cls, max_tokens: int | None, mean: MeanAnswer) -> Answer:
        tokens = mean.tokens if max_tokens is None else min(float(max_tokens), mean.tokens)
        return cls(max(1.0, tokens), mean.tokens, mean.decode_s)

    @property
    def gap_weight(self) -> float:
        """A second of this answer's own gaps against a second of a mean answer's: the gaps
        it is spread over are fewer (a short answer's mean ITL feels a hand-off most)."""
        return max(1.0, self.mean_tokens - 1) / max(1.0, self.tokens - 1)

    @property
    def decode_s(self) -> float:
        """How long this answer is expected to decode."""
        return self.mean_decode_s * self.tokens / max(1.0, self.mean_tokens)
