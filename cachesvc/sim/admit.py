"""The router's admission in a replay (`router.admission`): a request predicted to start later
than the target is refused, the prediction scaled as the router scales it, by what admitted
requests took to their first token against theirs (`TTFTScale`, learnt as their first tokens
come, never from the future)."""

from __future__ import annotations

from cachesvc.sim.seq import SimSeq
from router.admission import Admission, CalibratedAdmission


class SimAdmission:
    """Admission for one replay; `admitted` each request it let in, with its raw prediction."""

    def __init__(self, ttft_s: float | None) -> None:
        self.calibrated = CalibratedAdmission(Admission(ttft_s))
        self._pending: list[tuple[SimSeq, float]] = []  # admitted, first token not seen yet

    @property
    def on(self) -> bool:
        return self.calibrated.on

    def refusal(self, predicted_s: float, queued_s: float) -> str | None:
        """Why a request predicted (raw) `predicted_s`, `queued_s` of it behind other work, is
        refused now, or None."""
        if not self.on:
            return None
        self._learn()
        return self.calibrated.refusal(predicted_s, queued_s)

    def admitted(self, seq: SimSeq, predicted_s: float) -> None:
        """`seq` (a request's first part: its prefill when handed off) was let in."""
        if self.on:
            self._pending.append((seq, predicted_s))

    def _learn(self) -> None:
        waiting = []
        for seq, predicted_s in self._pending:
            if not seq.token_times:
                waiting.append((seq, predicted_s))
                continue
            measured_s = seq.token_times[0] - seq.req.arrival_s
            self.calibrated.scale.observe(predicted_s, measured_s)
        self._pending = waiting
