"""What a prefill/decode hand-off costs whatever its size, learnt from measured hand-offs
(`HandoffCost`): the router's P/D plan and the simulator's both weigh it. Pure: the caller
passes the clock."""

from __future__ import annotations

from dataclasses import dataclass

# A hand-off's fixed cost before any is measured (`HandoffCost` learns it).
HANDOFF_FIXED_PRIOR_S = 0.02
# The weight of each measured hand-off in the learnt fixed cost; the most a residual counts for,
# in multiples of the estimate (or the prior, when higher); and the half-life (seconds) over
# which the estimate returns to its prior when no hand-off is measured.
HANDOFF_WEIGHT = 0.2
MAX_RESIDUAL_RATIO = 4.0
HANDOFF_HALF_LIFE_S = 60.0


@dataclass
class HandoffCost:
    """What a hand-off costs whatever its size (a second call to a worker, a step on each
    side), learnt from measured hand-offs whose pull succeeded; mutated by `observe`.

    Robust to the odd slow hand-off: each residual counts for at most `MAX_RESIDUAL_RATIO`
    times the estimate (a pull that waited out a frozen holder moves it by a few tens of
    percent, not by seconds; a real rise is still learnt, 1.6x per hand-off), a pull that
    failed or timed out is not learnt from at all (its wait is the timeout's, not the
    hand-off's), and the estimate decays toward `prior_s` with time. So a wrong estimate that
    keeps every request colocated, and hence measures no hand-off, still recovers."""

    prior_s: float
    weight: float = HANDOFF_WEIGHT
    half_life_s: float = HANDOFF_HALF_LIFE_S
    _learnt_s: float | None = None
    _at_s: float = 0.0

    def value(self, now_s: float) -> float:
        """The estimate at `now_s` (seconds on a monotonic clock)."""
        if self._learnt_s is None:
            return self.prior_s
        decay = 0.5 ** (max(0.0, now_s - self._at_s) / self.half_life_s)
        return self.prior_s + (self._learnt_s - self.prior_s) * decay

    def observe(self, residual_s: float, now_s: float) -> None:
        """A successful hand-off measured `residual_s` beyond the part of its prediction that
        scales with the request."""
        current = self.value(now_s)
        ceiling = MAX_RESIDUAL_RATIO * max(current, self.prior_s)
        clamped = min(max(0.0, residual_s), ceiling)
        self._learnt_s = current + self.weight * (clamped - current)
        self._at_s = now_s
