"""What each worker was given lately, forgotten by time: the memory behind `prefix_aware`'s
traffic bound and its tie-break on recent work.

Amounts decay with a half-life in seconds, not in decisions, so a worker's share means the same
in a cluster of 2 workers and one of 128 with the same load per worker (with a half-life in
decisions, a big cluster remembers less than one request per worker). A worker missing from the
candidates for a half-life (dead, drained, replaced) is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable

from cachesvc.types import WorkerId


class RecentAmounts:
    """Per worker, the sum of amounts given to it, each weighted by 2^(-age / half-life)."""

    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError(f"a half-life must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._amounts: dict[WorkerId, float] = {}
        self._seen_s: dict[WorkerId, float] = {}  # when each was last a candidate
        self._now_s: float | None = None

    def advance(self, now_s: float, present: Iterable[WorkerId]) -> None:
        """Decay everything to `now_s` (a clock that never goes back: an earlier time decays
        nothing), note the workers `present` as seen now and forget those unseen for a
        half-life."""
        if self._now_s is not None and now_s > self._now_s:
            factor = 0.5 ** ((now_s - self._now_s) / self.half_life_s)
            for worker in self._amounts:
                self._amounts[worker] *= factor
        self._now_s = now_s if self._now_s is None else max(self._now_s, now_s)
        for worker in present:
            self._seen_s[worker] = self._now_s
        gone = [w for w, t in self._seen_s.items() if self._now_s - t > self.half_life_s]
        for worker in gone:
            del self._seen_s[worker]
            self._amounts.pop(worker, None)

    def add(self, worker: WorkerId, amount: float) -> None:
        self._amounts[worker] = self._amounts.get(worker, 0.0) + amount

    def get(self, worker: WorkerId) -> float:
        return self._amounts.get(worker, 0.0)

    def mean(self, workers: Iterable[WorkerId]) -> float:
        """The mean amount over `workers` (0 for none): whoever left them weighs nothing."""
        values = [self.get(w) for w in workers]
        return sum(values) / len(values) if values else 0.0

    def known(self) -> set[WorkerId]:
        """The workers remembered (seen within a half-life)."""
        return set(self._seen_s)
