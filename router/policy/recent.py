"""What each worker was given lately, and how long it was busy lately, forgotten by time: the
memory behind `prefix_aware`'s traffic bound and its balance of busy seconds.

Amounts decay with a half-life in seconds, not in decisions, so a worker's share means the same
in a cluster of 2 workers and one of 128 with the same load per worker (with a half-life in
decisions, a big cluster remembers less than one request per worker). A worker missing from the
candidates for a half-life (dead, drained, replaced) is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cachesvc.kv.types import WorkerId


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
            factor = self._decay(now_s)
            for worker in self._amounts:
                self._amounts[worker] *= factor
        self._now_s = now_s if self._now_s is None else max(self._now_s, now_s)
        for worker in present:
            self._seen_s[worker] = self._now_s
        gone = [w for w, t in self._seen_s.items() if self._now_s - t > self.half_life_s]
        for worker in gone:
            del self._seen_s[worker]
            self._amounts.pop(worker, None)

    def at(self, now_s: float, present: Iterable[WorkerId]) -> dict[WorkerId, float]:
        """Each of the workers `present` at `now_s`: its amount as `advance(now_s, present)`
        then `get` would read it, to the bit, without noting anything (pure). A worker
        present is never forgotten, so its decayed amount is all there is to it."""
        factor = self._decay(now_s)
        return {worker: self._amounts.get(worker, 0.0) * factor for worker in present}

    def _decay(self, now_s: float) -> float:
        """The factor from the last time advanced to `now_s` (1 for an earlier time)."""
        if self._now_s is None or now_s <= self._now_s:
            return 1.0
        return 0.5 ** ((now_s - self._now_s) / self.half_life_s)

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


class BusySeconds:
    """Per worker, the seconds it had work lately (running or waiting requests), as seen at each
    decision and decayed like `RecentAmounts`: from one sighting of a worker to the next, it
    counts as busy for the whole interval when it had work at the first.

    This is what a worker's accelerator spent stepping, whatever made it: long answers the
    router cannot foresee, long prompts, or many requests. A worker's share of it is the
    balance the router can measure, where counting requests or prompt tokens only guesses.
    """

    def __init__(self, half_life_s: float) -> None:
        self._seconds = RecentAmounts(half_life_s)
        self._last: dict[WorkerId, tuple[float, bool]] = {}  # when last seen, and busy then

    def observe(self, now_s: float, loads: Iterable[tuple[WorkerId, bool]]) -> None:
        """Note each worker of `loads` as seen at `now_s`, busy or not; credit the interval
        since its last sighting to those busy then. Workers forgotten by the decay (unseen for
        a half-life) start afresh."""
        seen = list(loads)
        self._seconds.advance(now_s, (w for w, _ in seen))
        known = self._seconds.known()
        for worker, busy in seen:
            last = self._last.get(worker)
            # Credited at full weight though decay began mid-interval: intervals between
            # decisions are far shorter than a half-life.
            if last is not None and last[1]:
                self._seconds.add(worker, max(0.0, now_s - last[0]))
            self._last[worker] = (now_s, busy)
        for worker in [w for w in self._last if w not in known]:
            del self._last[worker]

    def at(self, now_s: float, loads: Iterable[tuple[WorkerId, bool]]) -> dict[WorkerId, float]:
        """Each worker of `loads` at `now_s`: its seconds as `observe(now_s, loads)` then
        `get` would read them, to the bit, without noting anything (pure)."""
        seconds = self._seconds.at(now_s, (w for w, _ in loads))
        for worker in seconds:
            last = self._last.get(worker)
            if last is not None and last[1]:
                seconds[worker] += max(0.0, now_s - last[0])
        return seconds

    def given(self, worker: WorkerId, now_s: float) -> None:
        """`worker` was just given a request: busy from now on, whatever its last load said."""
        self._last[worker] = (now_s, True)

    def get(self, worker: WorkerId) -> float:
        return self._seconds.get(worker)

    def mean(self, workers: Iterable[WorkerId]) -> float:
        """The mean over `workers` (0 for none)."""
        return self._seconds.mean(workers)


@dataclass(frozen=True)
class Lately:
    """What a policy remembers of each worker present at one decision, read without noting
    anything (`RecentAmounts.at`, `BusySeconds.at`): the requests it was given lately, its busy
    seconds lately and the prefill tokens it was given lately."""

    traffic: Mapping[WorkerId, float]
    busy: Mapping[WorkerId, float]
    work: Mapping[WorkerId, float]


def mean_of(amounts: Mapping[WorkerId, float]) -> float:
    """The mean of `amounts` (0 for none), summed in their order as `RecentAmounts.mean` sums."""
    values = list(amounts.values())
    return sum(values) / len(values) if values else 0.0
