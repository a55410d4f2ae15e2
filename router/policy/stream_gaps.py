"""How fast a worker's streams decode lately: the mean gap between consecutive tokens of the
streams it serves, over the last few seconds, as the router sees the tokens arrive (the
simulator times them the same way). Admission (`router.policy.admission`) refuses to add work to a
worker whose streams already miss the inter-token target.

The mean is token-weighted, a ratio of two decayed sums (seconds of gaps over gaps), so a step
that computed a prompt chunk weighs as the long gap every stream in it saw: what the streams'
own mean inter-token latencies are made of.
"""

from __future__ import annotations

# The gaps' half-life (seconds): a few seconds of decoding, shorter than an answer's life (an
# H100 decodes 300 tokens in ~5 s, a CPU worker here 100 in ~8 s), so a worker that stops
# computing prompts reads as fast again before its streams end.
GAP_HALF_LIFE_S = 2.0
# Below this many gaps' weight, nothing is known: the mean of one stale gap says little.
MIN_GAPS = 1.0


class RecentGaps:
    """One worker's recent inter-token gaps; mutated by `observe`."""

    def __init__(self, half_life_s: float = GAP_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"a half-life must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._seconds = 0.0
        self._count = 0.0
        self._now_s: float | None = None

    def _decay(self, now_s: float) -> None:
        if self._now_s is not None and now_s > self._now_s:
            factor = 0.5 ** ((now_s - self._now_s) / self.half_life_s)
            self._seconds *= factor
            self._count *= factor
        self._now_s = now_s if self._now_s is None else max(self._now_s, now_s)

    def observe(self, now_s: float, seconds: float, num_gaps: int = 1) -> None:
        """`num_gaps` tokens of one stream came at `now_s`, `seconds` after its previous one
        (several at once share that time)."""
        if num_gaps <= 0 or seconds < 0:
            return
        self._decay(now_s)
        self._seconds += seconds
        self._count += num_gaps

    def mean_s(self, now_s: float) -> float | None:
        """The mean gap (seconds) of the recent tokens; None when too few came lately."""
        self._decay(now_s)
        if self._count < MIN_GAPS:
            return None
        return self._seconds / self._count
