"""The per-request disaggregation decision (`router.policy.pd.decide`): from calibrated costs and
load, not from a prompt-length threshold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachesvc.kv.types import WorkerId
from router.policy.answers import MEAN_ANSWER_PRIOR, Answer, MeanAnswer
from router.policy.pd import SLO, DecodeSide, PrefillSide, decide, with_answers
from router.policy.pd_pick import DecodeLoad, pick_decode

BLOCK = 16
TOKEN_S = 1e-4  # 10 000 prompt tokens a second
PULL_BLOCK_S = 2e-4  # a block's pull: an eighth of its compute (16 tokens: 1.6 ms)


def _decode(uncached: int, running: int, queued: int = 0, pull: float | None = PULL_BLOCK_S):
    return DecodeSide(WorkerId("d"), uncached, queued, running, TOKEN_S, pull)


def _prefill(uncached: int, queued: int = 0) -> PrefillSide:
    return PrefillSide(WorkerId("p"), uncached, queued, TOKEN_S)


def test_idle_decode_worker_keeps_a_long_prompt() -> None:
    """Nobody to disturb and nothing to move: colocated, however long the prompt."""
    d = decide(8000, BLOCK, _decode(8000, running=0), _prefill(8000))
    assert not d.disaggregate
    assert d.colocated_ttft_s == pytest.approx(0.8)
    assert d.colocated_stall_s == 0


def test_busy_decode_batch_sends_the_prompt_away() -> None:
    d = decide(8000, BLOCK, _decode(8000, running=16), _prefill(8000))
    assert d.disaggregate and d.mode == "disaggregated"
    assert d.pull_blocks == 500
    assert d.disaggregated_ttft_s == pytest.approx(0.8)
    # 16 streams would each lose the 0.8 s prefill colocated.
    assert d.colocated_stall_s == pytest.approx(16 * 0.8)
    assert d.disaggregated_stall_s < d.colocated_stall_s / 10
    assert "disaggregated" in d.reason


def test_queued_prefill_worker_keeps_it_home() -> None:
    """The same busy batch, but the prefill worker has 10 s of prompts queued."""
    d = decide(8000, BLOCK, _decode(8000, running=4), _prefill(8000, queued=100_000))
    assert not d.disaggregate


def test_short_prompt_moves_only_when_the_batch_is_large() -> None:
    """A hand-off's fixed cost (20 ms) outweighs 64 tokens' prefill for a few streams."""
    small = decide(64, BLOCK, _decode(64, running=2), _prefill(64), handoff_fixed_s=0.02)
    large = decide(64, BLOCK, _decode(64, running=200), _prefill(64), handoff_fixed_s=0.02)
    assert not small.disaggregate and large.disaggregate


def test_decode_worker_that_cannot_pull_keeps_it() -> None:
    d = decide(8000, BLOCK, _decode(8000, running=64, pull=None), _prefill(8000))
    assert not d.disaggregate and "does not pull" in d.reason
    assert not decide(8000, BLOCK, _decode(8000, running=64), None).disaggregate


def test_cached_on_the_decode_worker_is_not_pulled() -> None:
    """The decode worker holds half the prompt: it pulls only the rest."""
    d = decide(8000, BLOCK, _decode(4000, running=16), _prefill(8000))
    assert d.pull_blocks == 250


def test_stall_weight_zero_is_the_requests_own_latency() -> None:
    d = decide(8000, BLOCK, _decode(8000, running=64), _prefill(8000), stall_weight=0.0)
    assert not d.disaggregate  # for the request alone, moving never pays here


def test_pick_decode_by_decode_load() -> None:
    loads = [
        DecodeLoad(WorkerId("a"), 8, 0, 100, 0),
        DecodeLoad(WorkerId("b"), 2, 1, 10, 500),
        DecodeLoad(WorkerId("c"), 2, 1, 50, 500),
        DecodeLoad(WorkerId("d"), 4, 0, 900, 0),
    ]
    assert pick_decode(loads) == "c"  # fewest streams, equal queue, most free blocks


def test_config_names_a_bad_mode() -> None:
    from cachesvc.kv.config import ConfigError
    from router.config import RouterConfig

    with pytest.raises(ConfigError, match="pd_mode"):
        RouterConfig(pd_mode="sometimes")
    with pytest.raises(ConfigError, match="pd_stall_weight"):
        RouterConfig(pd_stall_weight=-1)


def test_an_itl_target_protects_the_running_streams() -> None:
    """The prefill worker's queue makes moving slower in total, but colocated the 4 streams
    each wait 0.8 s for a token: with answers of 3 tokens (two gaps) and a 0.2 s mean target,
    that breaks each one's mean (0.4 s) and fewer targets break moved."""
    decode, prefill = _decode(8000, running=4), _prefill(8000, queued=100_000)
    assert not decide(8000, BLOCK, decode, prefill).disaggregate
    d = decide(8000, BLOCK, decode, prefill, slo=SLO(itl_s=0.2, mean_answer=3))
    assert d.disaggregate and "SLO misses 0 moved vs 4 kept" in d.reason


def test_a_stall_spread_over_a_long_answer_breaks_no_mean_target() -> None:
    """The same 0.8 s stall over answers of 200 tokens adds 4 ms to each stream's mean: no
    stream misses a 0.2 s mean, so the delays decide (colocated), not the streams' next gap."""
    decode, prefill = _decode(8000, running=4), _prefill(8000, queued=100_000)
    d = decide(8000, BLOCK, decode, prefill, slo=SLO(itl_s=0.2, mean_answer=200))
    assert not d.disaggregate and "SLO misses 0 moved vs 0 kept" in d.reason


def test_a_ttft_target_keeps_it_home_when_nobody_decodes() -> None:
    decode, prefill = _decode(8000, running=0), _prefill(8000, queued=100_000)
    d = decide(8000, BLOCK, decode, prefill, slo=SLO(ttft_s=2.0, itl_s=0.2))
    assert not d.disaggregate  # moved breaks the TTFT target (10.8 s), kept breaks none


def test_slo_counts_what_breaks() -> None:
    slo = SLO(ttft_s=1.0, itl_s=0.1, mean_answer=11)  # a mean ITL budget of 1 s per answer
    assert slo.misses(0.5, (), 8, 0.9) == 0
    assert slo.misses(1.5, (1.2,), 8, 1.2) == 1 + 1 + 8
    assert slo.misses(0.5, (0.6, 0.6), 8, 0.5) == 1, "its own gaps are one mean"
    assert SLO().misses(100.0, (100.0,), 8, 100.0) == 0


def test_the_stall_weight_follows_the_targets() -> None:
    # A second of a 150-token answer's ITL budget (100 ms over 149 gaps) against a second of
    # the 2 s TTFT budget.
    assert SLO(2.0, 0.1, 150).stall_weight == pytest.approx(2.0 / (149 * 0.1))
    assert SLO(itl_s=0.1).stall_weight is None and SLO(ttft_s=2.0).stall_weight is None


def test_targets_bring_their_own_stall_weight() -> None:
    slo, weight = with_answers(SLO(2.0, 0.1), 151, 1.0)
    assert slo == SLO(2.0, 0.1, 151) and weight == pytest.approx(2.0 / (150 * 0.1))
    assert with_answers(SLO(itl_s=0.1), 151, 1.0)[1] == 1.0, "one target: the configured weight"
    assert with_answers(None, 151, 0.5) == (None, 0.5)


def test_the_mean_answer_is_learnt_from_its_prior() -> None:
    mean = MeanAnswer()
    assert mean.tokens == MEAN_ANSWER_PRIOR
    for _ in range(1000):
        mean.observe(10)
    assert 10 < mean.tokens < 15, "a thousand answers outweigh the prior"


def test_a_mixed_prefill_worker_counts_its_own_streams() -> None:
    """Between mixed workers the prompt runs on the policy's choice either way: its 16 streams
    lose the 0.8 s prefill whether the decode moves or not, so moving only adds the hand-off.
    A prefill worker decodes nothing: the same request moves (as it always has)."""
    here = DecodeSide(WorkerId("w"), 8000, 0, 16, TOKEN_S, PULL_BLOCK_S)
    away = DecodeSide(WorkerId("d"), 8000, 0, 0, TOKEN_S, PULL_BLOCK_S)
    mixed = PrefillSide(WorkerId("w"), 8000, 0, TOKEN_S, num_running=16)
    d = decide(8000, BLOCK, here, mixed, away)
    assert not d.disaggregate
    assert d.disaggregated_stall_s == pytest.approx(16 * 0.8)  # the decode side has no streams
    pure = PrefillSide(WorkerId("p"), 8000, 0, TOKEN_S)
    assert decide(8000, BLOCK, here, pure, away).disaggregate


def test_the_decode_side_must_be_another_worker() -> None:
    here = DecodeSide(WorkerId("w"), 8000, 0, 16, TOKEN_S, PULL_BLOCK_S)
    d = decide(8000, BLOCK, here, PrefillSide(WorkerId("w"), 8000, 0, TOKEN_S), here)
    assert not d.disaggregate and "one worker for both" in d.reason


_sides = st.tuples(
    st.integers(0, 20_000),  # uncached
    st.integers(0, 200_000),  # queued
    st.integers(0, 256),  # running
    st.floats(1e-6, 1e-3),  # seconds per token
)


@given(
    num_tokens=st.integers(1, 20_000),
    here=_sides,
    away=_sides,
    weight=st.floats(0.0, 10.0),
    fixed_s=st.floats(0.0, 0.1),
    slo=st.sampled_from([None, SLO(2.0, 0.1), SLO(itl_s=0.05), SLO(ttft_s=1.0)]),
    shares=st.tuples(st.floats(0.0, 0.9), st.floats(0.0, 0.9)),
    answer=st.one_of(
        st.none(), st.builds(Answer, st.floats(1, 2000), st.floats(1, 2000), st.floats(0, 60))
    ),
)
def test_a_hand_off_from_the_policys_choice_never_beats_colocated(
    num_tokens: int,
    here: tuple[int, int, int, float],
    away: tuple[int, int, int, float],
    weight: float,
    fixed_s: float,
    slo: SLO | None,
    shares: tuple[float, float],
    answer: Answer | None,
) -> None:
    """Over mixed workers, with the prompt where it would run colocated: the request's TTFT
    and its worker's streams' loss are the same, the hand-off and the decode side's loss come
    on top, so `decide` keeps it (colocated is one of its options) unless the decode side
    computes prompts less of its time (its stream would wait less on them)."""
    uncached, queued, running, token_s = here
    kept_share, moved_share = max(shares), min(shares)
    prompt_side = PrefillSide(WorkerId("w"), uncached, queued, token_s, running)
    colocated = DecodeSide(
        WorkerId("w"), uncached, queued, running, token_s, PULL_BLOCK_S, moved_share
    )
    decode = DecodeSide(WorkerId("d"), *away, PULL_BLOCK_S, kept_share)
    d = decide(num_tokens, BLOCK, colocated, prompt_side, decode, weight, fixed_s, slo, answer)
    assert not d.disaggregate, d.reason


def test_a_pull_while_the_prefill_runs_leaves_the_last_chunk_for_the_hand_off() -> None:
    busy = _decode(8000, running=16)
    after = decide(8000, BLOCK, busy, _prefill(8000))
    chunked = PrefillSide(WorkerId("p"), 8000, 0, TOKEN_S, chunk_tokens=2000)
    early = decide(8000, BLOCK, busy, chunked)
    # 500 blocks pulled after the token: 0.1 s; chunk by chunk, the last chunk's 125: 0.025 s.
    assert after.handoff_s == pytest.approx(0.1 + (8000 - 500 * BLOCK + 1) * TOKEN_S)
    assert early.handoff_s == pytest.approx(after.handoff_s - 0.075)
    assert early.pull_blocks == after.pull_blocks  # as much moves either way
    # A link slower than the prefill leaves its backlog: 2.0 s of pull against 0.6 s overlapped.
    slow = DecodeSide(WorkerId("d"), 8000, 0, 16, TOKEN_S, 4e-3)
    assert decide(8000, BLOCK, slow, chunked).handoff_s == pytest.approx(2.0 - 0.6 + 1e-4)
    # A prompt of one chunk moves after its token, as without.
    one = PrefillSide(WorkerId("p"), 8000, 0, TOKEN_S, chunk_tokens=8192)
    assert decide(8000, BLOCK, busy, one).handoff_s == pytest.approx(after.handoff_s)


def test_an_answer_is_bounded_by_its_max_tokens() -> None:
    mean = MeanAnswer()
    assert mean.decode_s == 0.0, "nothing decoded yet"
    mean.observe(201, decode_s=4.0)
    mean.observe(199, decode_s=2.0)
    mean.observe(1)  # a one-token answer has no decode time to tell
    assert mean.decode_s == pytest.approx(3.0)
    short = Answer.of(11, mean)
    assert short.tokens == 11 and short.mean_tokens == mean.tokens
    assert short.gap_weight == pytest.approx((mean.tokens - 1) / 10)
    assert short.decode_s == pytest.approx(3.0 * 11 / mean.tokens)
    unbounded = Answer.of(None, mean)
    assert unbounded.tokens == mean.tokens and unbounded.gap_weight == 1.0
    assert Answer.of(10**6, mean) == unbounded, "max_tokens bounds it, never lengthens it"


def test_a_short_answer_keeps_its_stream_whole() -> None:
    """16 streams would lose a 0.8 s prefill, so a mean answer moves. A 3-token answer's only
    gaps are the hand-off's: spread over 2 gaps rather than 199, the same 0.1 s weighs ~100x
    and it stays (the ITL goodput counts is its mean gap)."""
    mean = MeanAnswer()
    mean.observe(200, decode_s=2.0)
    busy, prefill = _decode(8000, running=16), _prefill(8000)
    weight = 0.05
    moved = decide(8000, BLOCK, busy, prefill, None, weight, 0.1, answer=Answer.of(None, mean))
    kept = decide(8000, BLOCK, busy, prefill, None, weight, 0.1, answer=Answer.of(3, mean))
    assert moved.disaggregate and not kept.disaggregate
    assert "handoff" in kept.reason


def test_a_stream_avoids_a_worker_that_keeps_computing_prompts() -> None:
    """Its worker spends 0.6 of its time on prompts: over its 10 s decode the stream would
    wait 6 s on them, against 0.6 s on a decode worker at 0.06; nobody decodes on either now,
    so only that wait tells them apart."""
    mean = MeanAnswer()
    mean.observe(int(mean.tokens), decode_s=10.0)
    answer = Answer.of(None, mean)
    here = DecodeSide(WorkerId("w"), 8000, 0, 0, TOKEN_S, PULL_BLOCK_S, prefill_share=0.6)
    quiet = DecodeSide(WorkerId("d"), 8000, 0, 0, TOKEN_S, PULL_BLOCK_S, prefill_share=0.06)
    d = decide(8000, BLOCK, here, _prefill(8000), quiet, 1.0, 0.02, answer=answer)
    assert d.disaggregate and "wait 600" in d.reason
    assert not decide(8000, BLOCK, here, _prefill(8000), quiet, 1.0, 0.02).disaggregate
    targets = SLO(2.0, 0.02, mean_answer=mean.tokens)  # 6 s over 199 gaps breaks 20 ms
    d = decide(8000, BLOCK, here, _prefill(8000), quiet, 1.0, 0.02, targets, answer)
    assert d.disaggregate and "SLO misses 0 moved vs 1 kept" in d.reason
