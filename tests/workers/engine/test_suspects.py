"""Suspects: whom a failed model run fails (a table of run histories against the rule), and the
scheduler running suspects alone, one per step, while the others wait or run when it cannot."""

from __future__ import annotations

import pytest

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.types import RequestId
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request import Request
from workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from workers.engine.suspects import Suspects, Verdict
from workers.sampling_params import SamplingParams

R, B, W = Verdict.REQUEUED, Verdict.BLAME, Verdict.WORKER_FAULT


def _chunks(spec: str) -> list[ScheduledChunk]:
    """'a b:6' -> a chunk of request a ending at position 10, one of b ending at 6."""
    out = []
    for item in spec.split():
        rid, _, end = item.partition(":")
        out.append(ScheduledChunk(RequestId(rid), (1,) * int(end or 10), 0, (), True))
    return out


# Each case: the runs in order ("ok a b" succeeded, "fail a b" raised, "gone a" left), the
# verdicts of the failed runs, and the suspects left, in their order.
CASES = {
    "a failed batch makes suspects": (["fail a b c"], [R], "a b c"),
    "each clean alone clears": (["fail a b c", "ok a", "ok b", "ok c"], [R], ""),
    "a batch does not clear": (["fail a b", "ok a b"], [R], "a b"),
    "alone but short of its failed run": (["fail a b", "ok a:6"], [R], "a b"),
    "poison, witnessed": (
        ["fail a b c", "fail a", "ok b", "ok c", "fail a"],
        [R, R, B],
        "",
    ),
    "a struck suspect runs after the others": (["fail a b c", "fail a"], [R, R], "b c a"),
    "two distinct alone in a row": (["fail a b c", "fail a", "fail b"], [R, R, W], ""),
    "alone on the worker, twice": (["fail a", "fail a"], [R, B], ""),
    "blamed unwitnessed, then another": (["fail a", "fail a", "fail b"], [R, B, W], ""),
    "blamed unwitnessed, a clean run": (["fail a", "fail a", "ok b", "fail b"], [R, B, R], "b"),
    "a transient fault alone": (["fail a", "ok a"], [R], ""),
    "two poisoned, witnesses between": (
        ["fail p i q j", "fail p", "ok i", "fail q", "ok j", "fail p", "fail q"],
        [R, R, R, B, B],
        "",
    ),
    "a suspect that leaves": (["fail a b", "gone a"], [R], "b"),
}


@pytest.mark.parametrize("case", CASES)
def test_whom_a_failed_run_fails(case: str) -> None:
    runs, verdicts, left = CASES[case]
    suspects = Suspects()
    got = []
    for run in runs:
        what, _, spec = run.partition(" ")
        if what == "ok":
            suspects.on_run(_chunks(spec))
        elif what == "fail":
            got.append(suspects.on_failed_run(_chunks(spec)))
        else:
            suspects.discard(RequestId(spec))
        suspects.check_integrity()
    assert got == verdicts
    assert suspects.in_order() == left.split()


def _make(num_blocks: int, **cfg: object) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), 4)
    return Scheduler(SchedulerConfig(**cfg), kv)  # type: ignore[arg-type]


def _req(name: str, prompt_len: int) -> Request:
    start = sum(map(ord, name)) * 1000
    return Request(RequestId(name), list(range(start, start + prompt_len)), SamplingParams())


def _ids(chunks: tuple[ScheduledChunk, ...]) -> list[str]:
    return [c.request_id for c in chunks]


def test_suspects_run_alone_then_batch_again() -> None:
    s = _make(64)
    a, b, c = _req("a", 10), _req("b", 7), _req("c", 5)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert _ids(out.chunks) == ["a", "b", "c"]
    s.kv.abort_step()
    s.requeue(out)
    assert s.suspects.on_failed_run(out.chunks) is Verdict.REQUEUED
    late = _req("late", 6)  # arrives after the failure: no suspect, it waits for them
    s.add(late)
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append(_ids(out.chunks))
        s.update(out)
    assert steps == [["a"], ["b"], ["c"]]
    assert not s.suspects
    for r in (a, b, c):  # each sampled its first token: the next step decodes all together
        r.append_token(7, 0.0)
    assert sorted(_ids(s.schedule().chunks)) == ["a", "b", "c", "late"]


def test_others_run_while_a_suspect_cannot_be_placed() -> None:
    s = _make(8)
    other = _req("other", 20)  # 5 of the 8 blocks
    s.add(other)
    s.update(s.schedule())
    suspect = _req("suspect", 16)  # needs 4 blocks (its 16th token computes in a 5th)
    s.add(suspect)
    s.suspects.on_failed_run([*_chunks("suspect:16"), *_chunks("gone:4")])
    s.suspects.discard(RequestId("gone"))
    other.append_token(7, 0.0)
    out = s.schedule()
    assert _ids(out.chunks) == ["other"]  # not the suspect: no room; and not both
    assert list(s.waiting) == [suspect]
    s.update(out)
    s.finish(other)
    assert _ids(s.schedule().chunks) == ["suspect"]
