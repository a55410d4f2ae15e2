"""Which workers a prefill/decode pair is made of (`router.policy.pd_pick`): the decode worker by
its streams and the share of its time it spends on prompts, and between mixed workers the one that
computes a prompt that may be handed off."""

from __future__ import annotations

import pytest

from cachesvc.kv.types import WorkerId
from router.policy.pd import PrefillSide
from router.policy.pd_pick import (
    MAX_PREFILL_SHARE,
    DecodeLoad,
    PrefillShare,
    pick_decode,
    pick_prefill,
)

TOKEN_S = 1e-4
W, P, Q = WorkerId("w"), WorkerId("p"), WorkerId("q")


def _share(shares: PrefillShare, worker: WorkerId, now_s: float) -> float:
    return shares.shares(now_s, [worker])[worker]


def test_a_steady_stream_of_prompt_work_reads_as_its_rate() -> None:
    """0.3 s of prefill sent every second: after a few windows the share reads 0.3 (it
    decays between sends, so it swings just around it); another worker reads nothing."""
    shares = PrefillShare(window_s=10.0)
    for t in range(100):
        shares.add(W, 0.3, float(t))
    at_99 = shares.shares(99.0, [W, P])
    assert at_99[W] == pytest.approx(0.3, rel=0.06)
    assert at_99[P] == 0.0
    assert _share(shares, W, 99.5) < at_99[W]


def test_the_share_fades_when_prompts_stop_and_is_capped() -> None:
    shares = PrefillShare(window_s=10.0)
    shares.add(W, 100.0, 0.0)  # a burst far past the window: capped
    assert _share(shares, W, 0.0) == MAX_PREFILL_SHARE
    shares.add(P, 5.0, 0.0)
    assert _share(shares, P, 0.0) == pytest.approx(0.5)
    assert _share(shares, P, 10.0) == pytest.approx(0.5 / 2.718281828, rel=1e-6)  # one window
    shares.add(P, -1.0, 10.0)  # nothing negative is ever added
    assert _share(shares, P, 10.0) == pytest.approx(0.5 / 2.718281828, rel=1e-6)


def test_a_worker_busy_with_prompts_decodes_as_if_it_had_more_streams() -> None:
    """Half its time on prompts, 2 streams: each decodes at the pace of 6 on an idle worker
    ((2 + 1) / 0.5), so a worker with 4 streams and no prompts (5) is the better decode worker;
    with no prompt work anywhere the fewest streams win, then the shortest queue, then the most
    free blocks."""
    busy = DecodeLoad(W, 2, 0, 500, 0, prefill_share=0.5)
    calm = DecodeLoad(P, 4, 0, 500, 0)
    assert pick_decode([busy, calm]) == P
    assert pick_decode([DecodeLoad(W, 2, 0, 500, 0), calm]) == W
    ties = [DecodeLoad(W, 2, 0, 10, 800), DecodeLoad(P, 2, 0, 10, 0), DecodeLoad(Q, 2, 0, 90, 0)]
    assert pick_decode(ties) == Q


def _side(worker: WorkerId, uncached: int, queued: int, streams: int) -> PrefillSide:
    return PrefillSide(worker, uncached, queued, TOKEN_S, streams)


def test_a_prompt_goes_where_it_stalls_fewer_streams_when_that_costs_nothing_else() -> None:
    """The policy chose `w` (16 streams); `p` holds as much of the prompt, has no more queued
    and decodes 2 streams: the 0.8 s prefill stalls 14 streams fewer there."""
    chosen = _side(W, 8000, 1000, 16)
    alike = _side(P, 8000, 500, 2)
    assert pick_prefill([chosen, alike], chosen, stall_weight=0.1) == alike
    # Weighing the streams at nothing, its own wait decides: p's queue is shorter.
    assert pick_prefill([chosen, alike], chosen, stall_weight=0.0) == alike
    assert pick_prefill([chosen, _side(P, 8000, 1000, 16)], chosen, 0.1) == chosen  # a tie


@pytest.mark.parametrize(
    "other",
    [
        _side(P, 8016, 0, 0),  # holds less of it: more work for the cluster
        _side(P, 7984, 0, 0),  # holds more: the policy's cache choice stands (it saw this)
        _side(P, 8000, 1001, 0),  # more queued: the policy's load balance stands
    ],
    ids=["holds-less", "holds-more", "queued-more"],
)
def test_the_policys_cache_and_load_choice_stands(other: PrefillSide) -> None:
    chosen = _side(W, 8000, 1000, 16)
    assert pick_prefill([chosen, other], chosen, stall_weight=1.0) == chosen
