"""Which workers a prefill/decode pair is made of: where a handed-off prompt is computed
between mixed workers (`pick_prefill`), and which worker decodes it (`pick_decode`), by the
streams each decodes and the share of its time it spends on prompts (`PrefillShare`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cachesvc.kv.types import WorkerId
from router.policy.pd import PrefillSide
from router.policy.recent import RecentAmounts

# How far back `PrefillShare` looks (seconds, the decay's time constant): a few answers' life
# (an H100 decodes 300 tokens in ~5 s; a CPU worker here 100 in ~8 s).
PREFILL_SHARE_WINDOW_S = 10.0
# A share above this is taken as this: a worker that only computes prompts still decodes.
MAX_PREFILL_SHARE = 0.9


class PrefillShare:
    """Each worker's recent prompt work as a share of its time: the predicted seconds of the
    prompts sent to it, decayed exponentially over `window_s` (`RecentAmounts`, with the
    half-life that gives); a steady stream of r seconds of prefill per second reads r. Mutated
    by `add` and `shares`."""

    def __init__(self, window_s: float = PREFILL_SHARE_WINDOW_S) -> None:
        self.window_s = window_s
        self._work = RecentAmounts(window_s * math.log(2))

    def add(self, worker: WorkerId, seconds: float, now_s: float) -> None:
        """`worker` was sent `seconds` of prompt work at `now_s`."""
        self._work.advance(now_s, (worker,))
        self._work.add(worker, max(0.0, seconds))

    def shares(self, now_s: float, workers: Iterable[WorkerId]) -> dict[WorkerId, float]:
        """The share of its time each of `workers` has lately spent on prompts, at most
        `MAX_PREFILL_SHARE` (workers not among them for a half-life are forgotten)."""
        present = list(workers)
        self._work.advance(now_s, present)
        return {w: min(MAX_PREFILL_SHARE, self._work.get(w) / self.window_s) for w in present}


def pick_prefill(
    candidates: Sequence[PrefillSide], chosen: PrefillSide, stall_weight: float
) -> PrefillSide:
    """Between mixed workers, where a prompt that may be handed off is computed: the policy's
    `chosen` worker, or one of the `candidates` that holds as much of the prompt and has no
    more prefill queued (the policy's cache reuse and load balance stand) where the queue, the
    prefill and the stall of the streams decoding there (`stall_weight` each) cost less. The
    decision (`decide`) then weighs colocated on `chosen` against a hand-off from it. Ties go
    to `chosen`."""

    def cost(side: PrefillSide) -> float:
        prefill_s = side.uncached_tokens * side.token_s
        wait_s = side.queued_tokens * side.token_s
        return wait_s + prefill_s + stall_weight * side.num_running * prefill_s

    alike = [
        c
        for c in candidates
        if c.worker != chosen.worker
        and c.uncached_tokens == chosen.uncached_tokens
        and c.queued_tokens <= chosen.queued_tokens
    ]
    return min([chosen, *alike], key=cost)


@dataclass(frozen=True)
class DecodeLoad:
    """What `pick_decode` sees of a decode-side worker."""

    worker: WorkerId
    num_running: int
    num_waiting: int
    free_blocks: int
    num_queued_tokens: int
    prefill_share: float = 0.0  # of its time lately spent on prompts (`PrefillShare`)


def pick_decode(loads: Sequence[DecodeLoad]) -> WorkerId:
    """The decode worker for a disaggregated request, by decode load: the fewest streams
    (running, waiting and the request's own) per share of time left from prompts (a worker
    computing prompts half the time decodes each stream at half the pace, as with twice the
    streams), then the least queued prefill work, then the most free KV blocks (never empty).
    Ties go to the first."""

    def load(w: DecodeLoad) -> tuple[float, int, int]:
        streams = (w.num_running + w.num_waiting + 1) / (1.0 - w.prefill_share)
        return streams, w.num_queued_tokens, -w.free_blocks

    return min(loads, key=load).worker


def fastest_prefill(candidates: Sequence[PrefillSide]) -> PrefillSide:
    """The prefill worker (of `candidates`, never empty) where a prompt's first token comes
    soonest: its queued prefill and the prompt's part it does not hold, at its own speed; ties
    go to the one that holds more of the prompt, then to the first."""
    return min(
        candidates,
        key=lambda c: ((c.queued_tokens + c.uncached_tokens) * c.token_s, c.uncached_tokens),
    )
