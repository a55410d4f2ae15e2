"""A live step's spread around its median, drawn for each simulated step.

A profile's step times are medians; a live worker's steps are not all the median (a garbage
collection, the event loop streaming a step's outputs late, the host's other work). The
calibration records that spread as quantiles of a lone stream's gaps less their median
(`CostProfile.step_jitter_s`); each simulated worker draws one extra per step from them, from a
generator seeded by its name, so a replay stays the same from run to run.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

# How much of its predicted time a step keeps at least, whatever a low quantile says: a draw
# below the median shortens a step, never to nothing.
MIN_SHARE = 0.5


class StepJitter:
    """Draws from quantiles at evenly spaced probabilities, linear between them."""

    def __init__(self, quantiles_s: Sequence[float], seed: str) -> None:
        self._quantiles = tuple(quantiles_s)
        self._rng = random.Random(seed)

    def draw(self) -> float:
        """One extra (s; 0 without quantiles)."""
        q = self._quantiles
        if len(q) < 2:
            return q[0] if q else 0.0
        x = self._rng.random() * (len(q) - 1)
        i = int(x)
        return q[i] + (q[i + 1] - q[i]) * (x - i)

    def apply(self, step_s: float) -> float:
        """`step_s` with one draw added, kept at least `MIN_SHARE` of itself."""
        if not self._quantiles:
            return step_s
        return max(step_s * MIN_SHARE, step_s + self.draw())


def quantiles(values: Sequence[float], n: int) -> tuple[float, ...]:
    """`values`' quantiles at probabilities 0, 1/n, ..., 1 (linear between order statistics)."""
    if len(values) < 2:
        return tuple(values) * (n + 1)
    inner = statistics.quantiles(values, n=n, method="inclusive")
    return (min(values), *inner, max(values))
