"""The router's admission in a replay (`router.policy.admission`): a request predicted to start
later than the target is refused, the prediction scaled as the router scales it, by what admitted
requests took to their first token against theirs (`TTFTScale`, learnt as their first tokens
come, never from the future); with an inter-token target, so is one that would join or stall
the streams of a worker decoding them slower than that lately (each worker's `RecentGaps`,
timed as its tokens come, and the mean answer, learnt from finished requests)."""

from __future__ import annotations

from collections.abc import Sequence

from cachesvc.sim.seq import SimSeq
from cachesvc.sim.worker import SimWorker
from router.policy.admission import Admission, CalibratedAdmission, streams_refusal
from router.policy.answers import MeanAnswer


class SimAdmission:
    """Admission for one replay; `admitted` each request it let in, with its raw prediction."""

    def __init__(self, admission: Admission | None = None) -> None:
        self.calibrated = CalibratedAdmission(admission or Admission())
        self._pending: list[tuple[SimSeq, float]] = []  # admitted, first token not seen yet
        # The answers' mean length, over which a prefill's stall is spread (shared with the
        # P/D routes, which learn it, as the router's admission shares the P/D plan's).
        self.mean_answer = MeanAnswer()

    @property
    def on(self) -> bool:
        return self.calibrated.on

    @property
    def itl_s(self) -> float | None:
        return self.calibrated.admission.itl_s

    def refusal(
        self,
        predicted_s: float,
        queued_s: float,
        stalls: Sequence[tuple[SimWorker, float]] = (),
        now_s: float = 0.0,
    ) -> str | None:
        """Why a request predicted (raw) `predicted_s`, `queued_s` of it behind other work, is
        refused at `now_s`, or None; `stalls` are the workers whose streams it would join or
        stall, and by how much each."""
        if not self.on:
            return None
        self._learn()
        refusal = self.calibrated.refusal(predicted_s, queued_s)
        if refusal is not None or self.itl_s is None:
            return refusal
        touched = (
            (w.worker_id, None if w.gaps is None else w.gaps.mean_s(now_s), stall_s, w.num_requests)
            for w, stall_s in stalls
        )
        return streams_refusal(self.calibrated.admission, touched, self.mean_answer.tokens)

    def admitted(self, seq: SimSeq, predicted_s: float) -> None:
        """`seq` (a request's first part: its prefill when handed off) was let in."""
        if self.on:
            self._pending.append((seq, predicted_s))

    def answered(self, seq: SimSeq) -> None:
        """`seq` finished its answer (colocated: the P/D routes learn their own)."""
        times = seq.token_times
        self.mean_answer.observe(seq.req.output_len, times[-1] - times[0] if times else None)

    def _learn(self) -> None:
        waiting = []
        for seq, predicted_s in self._pending:
            if not seq.token_times:
                waiting.append((seq, predicted_s))
                continue
            measured_s = seq.token_times[0] - seq.req.arrival_s
            self.calibrated.scale.observe(predicted_s, measured_s)
        self._pending = waiting
