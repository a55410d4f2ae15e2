"""Prefill/decode disaggregation, decided per request: serve it where it is (colocated), or
compute its prompt on a prefill worker and hand the KV to a decode worker (disaggregated).

The decision weighs, in seconds from each worker's calibrated costs and current load, what the
request itself waits and what it makes the streams already decoding wait:

- **colocated** on the decode-side worker `policy` chose: its first token after the work queued
  there and its own uncached prefill; every stream decoding there loses that prefill's time
  (a prefill shares the worker's steps with the decodes, chunked or not, so each running
  stream's tokens come that much later in all).
- **disaggregated**: its first token after the prefill worker's queue and uncached prefill; its
  second after the pull of the prompt's blocks (the decode worker's calibrated pull cost), the
  decode worker's queue and the tail it computes itself (the last partial block and the first
  token); the decode worker's running streams lose that tail and the landing of the pulled
  blocks (`LANDING_SHARE` of the pull), and the streams the prefill worker decodes (none on a
  prefill worker; a mixed worker's own, between mixed workers) lose the prefill.

Where the request decodes, its own stream waits on the prompts that worker will compute: the
share of its time the worker has lately spent on prompts (`router.policy.pd_pick.PrefillShare`) of
the answer's expected decode (`router.policy.answers.Answer`).

Disaggregated wins when its total (the request's wait plus `stall_weight` times the others'
loss, and its own stream's delays, the hand-off's gap and that wait, weighted as a stream's over
its own answer: a short answer's few gaps feel a hand-off most) is lower. No fixed prompt-length
threshold: a long prompt arriving at an idle decode
worker stays colocated (nobody to disturb, no transfer to pay); a short one lands on a prefill
worker when the decode batch is large enough that even it hurts. Pure: the router
(`router.request.disagg`) and the simulator (`cachesvc.sim`) both call `decide`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cachesvc.kv.types import WorkerId
from router.policy.answers import MEAN_ANSWER_PRIOR, Answer

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
ROLES = (MIXED, PREFILL, DECODE)

# Of a pull's measured time, the part the decode worker's own steps wait on: it lands the
# blocks between steps (a copy into its KV cache at ~4 GB/s here) while the gather, the transfer
# and the digest check run on the holder and on threads (`docs/benchmarks/kv-transfer.md`:
# landing ~0.3 of the pull's time at 1.3 GB/s end to end).
LANDING_SHARE = 0.3


@dataclass(frozen=True)
class PrefillSide:
    """The prefill worker the policy chose, as the decision sees it."""

    worker: WorkerId
    uncached_tokens: int  # prompt tokens it must compute (what it does not hold)
    queued_tokens: int  # prefill work ahead of the request there
    token_s: float  # its seconds of prefill per token (calibrated)
    # Streams it is decoding: none on a prefill worker; a mixed worker's wait on the prefill
    # whichever worker decodes the request.
    num_running: int = 0
    # With the decode worker pulling while the prefill runs (`router/request/prefetch.py`): the
    # tokens it computes a step (its chunk). None: the pull starts at the first token.
    chunk_tokens: int | None = None


@dataclass(frozen=True)
class DecodeSide:
    """The decode-side worker: where the request runs colocated, or its decode runs."""

    worker: WorkerId
    uncached_tokens: int  # prompt tokens it would compute itself, colocated
    queued_tokens: int  # prefill work ahead of the request there
    num_running: int  # streams it is decoding (their tokens wait on any prefill it runs)
    token_s: float  # its seconds of prefill per token (calibrated)
    pull_block_s: float | None  # its calibrated seconds per pulled block; None: it never pulls
    # The share of its time it has lately spent on prompts (`PrefillShare`): a stream decoding
    # there waits about that share of its life on the prompts still to come.
    prefill_share: float = 0.0


@dataclass(frozen=True)
class SLO:
    """Latency targets (seconds; None: no target): the request's time to first token, and the
    mean gap between two tokens over a stream's answer (the request's own, and those decoding
    beside it), as goodput counts them; `mean_answer` (tokens) is what a stall is spread over."""

    ttft_s: float | None = None
    itl_s: float | None = None
    mean_answer: float = MEAN_ANSWER_PRIOR

    @property
    def stall_weight(self) -> float | None:
        """A second a decoding stream loses against a second of the request's TTFT, each as a
        share of its budget: the TTFT target, and the ITL target over the mean answer's gaps
        (`ttft / ((mean answer - 1) * itl)`); None without both targets."""
        if self.ttft_s is None or self.itl_s is None:
            return None
        return self.ttft_s / (max(1.0, self.mean_answer - 1) * self.itl_s)

    def misses(
        self,
        ttft_s: float,
        own_gaps_s: Sequence[float],
        num_streams: int,
        stall_s: float,
        own_answer: float | None = None,
    ) -> int:
        """Targets a mode is predicted to break: the request's TTFT, its mean ITL (its own
        gaps, a hand-off's, spread over its answer of `own_answer` tokens, default the mean),
        and the mean ITL of each of `num_streams` running streams that lose `stall_s` (spread
        over the mean answer: the router knows neither how far a stream is nor its other gaps,
        taken as nothing)."""
        misses = 0
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            misses += 1
        if self.itl_s is not None:
            budget_s = self.itl_s * max(1.0, self.mean_answer - 1)
            own = self.mean_answer if own_answer is None else own_answer
            misses += sum(own_gaps_s) > self.itl_s * max(1.0, own - 1)
            if stall_s > budget_s:
                misses += num_streams
        return misses


def with_answers(
    slo: SLO | None, mean_answer: float, stall_weight: float
) -> tuple[SLO | None, float]:
    """The targets `decide` weighs with answers of `mean_answer` tokens, and its stall weight:
    the targets' own (`SLO.stall_weight`) when both are set, else `stall_weight`."""
    if slo is None:
        return None, stall_weight
    slo = dataclasses.replace(slo, mean_answer=mean_answer)
    weight = slo.stall_weight
    return slo, stall_weight if weight is None else weight


@dataclass(frozen=True)
class PDDecision:
    """Colocated or disaggregated, why, and what each mode was predicted to cost (seconds)."""

    disaggregate: bool
    reason: str
    colocated_ttft_s: float = 0.0
    disaggregated_ttft_s: float = 0.0
    handoff_s: float = 0.0  # disaggregated: the first token to the second (pull + tail)
    colocated_stall_s: float = 0.0  # decode time the decode worker's streams lose, colocated
    # The same, disaggregated: the tail and the landing, and the prefill on a mixed prefill side.
    disaggregated_stall_s: float = 0.0
    pull_blocks: int = 0  # disaggregated: blocks the decode worker pulls
    handoff_fixed_s: float = 0.0  # the part of `handoff_s` that does not scale with the request
    # The prompt's own compute where it would run (seconds), colocated and disaggregated.
    colocated_prefill_s: float = 0.0
    disaggregated_prefill_s: float = 0.0
    # Disaggregated: what each stream decoding on the decode worker loses (the tail, the landing).
    decode_stall_s: float = 0.0

    @property
    def prefill_s(self) -> float:
        """The prompt's compute where it runs."""
        return self.disaggregated_prefill_s if self.disaggregate else self.colocated_prefill_s

    @property
    def predicted_ttft_s(self) -> float:
        return self.disaggregated_ttft_s if self.disaggregate else self.colocated_ttft_s

    @property
    def mode(self) -> str:
        return "disaggregated" if self.disaggregate else "colocated"


def decide(
    num_prompt_tokens: int,
    block_size: int,
    colocated: DecodeSide,
    prefill: PrefillSide | None,
    decode: DecodeSide | None = None,
    stall_weight: float = 1.0,
    handoff_fixed_s: float = 0.0,
    slo: SLO | None = None,
    answer: Answer | None = None,
) -> PDDecision:
    """Colocated on `colocated.worker`, or prefill on `prefill.worker` and decode on
    `decode.worker` (default: the colocated one). `None` for `prefill` (no prefill worker) or a
    decode worker that cannot pull is colocated. `handoff_fixed_s` is what a hand-off costs
    whatever its size (a second call, a step on each side: the router measures it). With an
    `slo`, the mode that breaks fewer targets wins (`SLO.misses`), and the delays decide only
    between modes that break as many.

    With the request's `answer` known, its own stream's delays count as a decoding stream's
    (`stall_weight`, scaled by `Answer.gap_weight`): the hand-off's gap, and the share of its
    decode it waits on the prompts its worker will compute (`prefill_share`); without, the
    hand-off counts as TTFT and nothing is waited."""
    decode = colocated if decode is None else decode
    local_s = colocated.uncached_tokens * colocated.token_s
    colocated_ttft = colocated.queued_tokens * colocated.token_s + local_s
    colocated_stall = colocated.num_running * local_s
    stream_s = 0.0 if answer is None else answer.decode_s
    own_weight = 1.0 if answer is None else stall_weight * answer.gap_weight
    own_answer = None if answer is None else answer.tokens
    kept_wait_s = colocated.prefill_share * stream_s  # its own stream's, on prompts to come
    stay = PDDecision(
        False, "", colocated_ttft, colocated_stall_s=colocated_stall, colocated_prefill_s=local_s
    )
    if prefill is None:
        return dataclasses.replace(stay, reason="colocated: no prefill worker")
    if decode.pull_block_s is None:
        return dataclasses.replace(stay, reason="colocated: the decode worker does not pull")
    if prefill.worker == decode.worker:
        return dataclasses.replace(stay, reason="colocated: one worker for both")
    full_blocks = num_prompt_tokens // block_size
    # The decode worker pulls the prompt's full blocks it does not hold, and computes the rest.
    held = max(0, num_prompt_tokens - decode.uncached_tokens) // block_size
    pull_blocks = max(0, full_blocks - held)
    tail = num_prompt_tokens - full_blocks * block_size + 1  # the partial block and the token
    pull_s = pull_blocks * decode.pull_block_s
    tail_s = tail * decode.token_s
    prefill_s = prefill.uncached_tokens * prefill.token_s
    ttft = prefill.queued_tokens * prefill.token_s + prefill_s
    waited_s = early_pull_s(prefill, pull_blocks, block_size, decode.pull_block_s, prefill_s)
    handoff = handoff_fixed_s + waited_s + decode.queued_tokens * decode.token_s + tail_s
    decode_stall_s = tail_s + LANDING_SHARE * pull_s
    stall = prefill.num_running * prefill_s + decode.num_running * decode_stall_s
    moved_wait_s = decode.prefill_share * stream_s
    stays = colocated_ttft + own_weight * kept_wait_s + stall_weight * colocated_stall
    moves = ttft + own_weight * (handoff + moved_wait_s) + stall_weight * stall
    disaggregate = moves < stays
    missed = ""
    if slo is not None:
        kept = slo.misses(
            colocated_ttft, (kept_wait_s,), colocated.num_running, local_s, own_answer
        )
        moved = slo.misses(
            ttft, (handoff, moved_wait_s), decode.num_running, decode_stall_s, own_answer
        )
        moved += slo.misses(0.0, (), prefill.num_running, prefill_s)
        if kept != moved:
            disaggregate = moved < kept
        missed = f"; SLO misses {moved} moved vs {kept} kept"
    reason = (
        f"{'disaggregated' if disaggregate else 'colocated'}: moved {moves * 1e3:.0f} ms "
        f"(prefill {ttft * 1e3:.0f} + handoff {handoff * 1e3:.0f} + stall {stall * 1e3:.0f} "
        f"+ wait {moved_wait_s * 1e3:.0f}) vs kept {stays * 1e3:.0f} ms (prefill "
        f"{colocated_ttft * 1e3:.0f} + stall {colocated_stall * 1e3:.0f} over "
        f"{colocated.num_running} streams + wait {kept_wait_s * 1e3:.0f}){missed}"
    )
    return PDDecision(
        disaggregate,
        reason,
        colocated_ttft,
        ttft,
        handoff,
        colocated_stall,
        stall,
        pull_blocks,
        handoff_fixed_s,
        local_s,
        prefill_s,
        decode_stall_s,
    )


def early_pull_s(
    prefill: PrefillSide, pull_blocks: int, block_size: int, pull_block_s: float, prefill_s: float
) -> float:
    """The part of a pull of `pull_blocks` left after the first token. Pulled from the first
    token on, all of it; pulled while the prefill runs, chunk by chunk as each is computed
    (`chunk_tokens`), the blocks of every chunk but the last move while the next computes: what
    is left is the last chunk's, or the backlog of a link slower than the prefill."""
    pull_s = pull_blocks * pull_block_s
    chunk = prefill.chunk_tokens
    if chunk is None or prefill.uncached_tokens <= chunk:
        return pull_s
    num_chunks = -(-prefill.uncached_tokens // chunk)
    last_s = min(pull_blocks, -(-chunk // block_size)) * pull_block_s
    overlap_s = prefill_s * (num_chunks - 1) / num_chunks
    return max(last_s, pull_s - overlap_s)


# Roles that serve whole requests (colocated) and decode handed-off ones.
SERVING_ROLES = frozenset({MIXED, DECODE})
