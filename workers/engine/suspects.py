"""Suspects: the requests of a batch whose model run raised, and the rule that says whom to
blame for a failed run.

A model run that raises says nothing about which request caused it: the input of one request
may break the forward deterministically (and would break every batch it joins, on every worker),
or the worker itself may be at fault (out of memory, a tier or Ray failure), for one run or for
good. The rule, applied by the engine after each failed run (the step undone and its requests
requeued first):

- A failed run of more than one request fails nothing: its requests become suspects. The
  scheduler runs suspects alone, one per step with no other request in it, until each has run
  alone through the position the failed run was to reach; then it batches as usual again.
- A request is blamed only when it fails alone, and only the second time: its first lone failure
  may be transient, so it runs alone once more, after the other suspects (the witnesses, when
  there are any). Failing alone again, it fails alone (finish reason "error": not retried).
- Lone failures of two distinct requests in a row, with no successful run between them, say the
  worker is at fault: every request fails, as a failed step always did (the router fails them
  over). So does a request blamed with no run succeeding between its two failures (it was alone
  on the worker: nothing told the worker and the request apart) followed by the next lone failure
  of another request: at most one request is wrongly blamed per worker fault.

One cost: two poisoned requests whose lone runs come back to back read as a worker fault, and
fail over.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

from cachesvc.kv.types import RequestId

if TYPE_CHECKING:
    from workers.engine.scheduler import ScheduledChunk


class Verdict(Enum):
    """What a failed model run means, by the rule in the module docstring."""

    REQUEUED = "requeued"  # nothing fails: the run's requests run again, suspects alone
    BLAME = "blame"  # the lone request's own input breaks the run: it fails alone
    WORKER_FAULT = "worker_fault"  # runs fail whatever they hold: every request fails


class Suspects:
    """The suspects in the order they are to run alone, and what failed alone so far.

    Pure bookkeeping: the scheduler asks it whom to run alone, the engine tells it how each run
    went (`on_run`, `on_failed_run`) and `discard`s requests that leave."""

    def __init__(self) -> None:
        # Each suspect -> the position its lone run must reach to be cleared; in run order.
        self._through: dict[RequestId, int] = {}
        self._struck: set[RequestId] = set()  # failed alone once
        self._witnessed: set[RequestId] = set()  # struck, and a run succeeded since
        self._last_lone_failure: RequestId | None = None  # None once any run succeeded

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._through

    def __bool__(self) -> bool:
        return bool(self._through)

    def in_order(self) -> list[RequestId]:
        """The suspects, the next to run alone first."""
        return list(self._through)

    def on_run(self, chunks: Sequence[ScheduledChunk]) -> None:
        """A model run over `chunks` succeeded: the worker works, and a suspect that ran alone
        through its failed position is cleared."""
        self._last_lone_failure = None
        self._witnessed |= self._struck
        if len(chunks) == 1:
            [chunk] = chunks
            through = self._through.get(chunk.request_id)
            if through is not None and _end(chunk) >= through:
                self.discard(chunk.request_id)

    def on_failed_run(self, chunks: Sequence[ScheduledChunk]) -> Verdict:
        """The model run over `chunks` raised (the step already undone): what it means.
        WORKER_FAULT forgets every suspect; BLAME forgets the blamed one."""
        if len(chunks) > 1:
            for chunk in chunks:
                self._accuse(chunk)
            return Verdict.REQUEUED
        [chunk] = chunks
        rid = chunk.request_id
        if self._last_lone_failure not in (None, rid):
            self.clear()
            return Verdict.WORKER_FAULT
        self._last_lone_failure = rid
        if rid in self._struck:
            if rid in self._witnessed:
                self._last_lone_failure = None  # explained: others ran since its first failure
            self.discard(rid)
            return Verdict.BLAME
        self._struck.add(rid)
        through = self._through.pop(rid, 0)  # to the end of the order: witnesses run first
        self._through[rid] = max(through, _end(chunk))
        return Verdict.REQUEUED

    def discard(self, request_id: RequestId) -> None:
        """Forget a request (finished, aborted, failed, or cleared); unknown ids are ignored."""
        self._through.pop(request_id, None)
        self._struck.discard(request_id)
        self._witnessed.discard(request_id)

    def clear(self) -> None:
        """Forget every suspect and every failure (the requests fail with the worker)."""
        self._through.clear()
        self._struck.clear()
        self._witnessed.clear()
        self._last_lone_failure = None

    def check_integrity(self) -> None:
        assert self._struck <= set(self._through), "a struck request is no suspect"
        assert self._witnessed <= self._struck, "a witnessed request was never struck"

    def _accuse(self, chunk: ScheduledChunk) -> None:
        self._through[chunk.request_id] = max(self._through.get(chunk.request_id, 0), _end(chunk))


def _end(chunk: ScheduledChunk) -> int:
    return chunk.start_pos + len(chunk.token_ids)
