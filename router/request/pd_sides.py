"""What a prefill/decode plan reads of the live workers, once per request: each worker's cached
match of the prompt and recent prompt work (`Seen`), and each worker as one side of the decision
sees it (`router.policy.pd.PrefillSide`, `DecodeSide`) or as `pick_decode` sees it (`DecodeLoad`).
Pure reads of the workers' states.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.costs import PEER, prefill_token_s
from router.policy.pd import PREFILL, DecodeSide, PrefillSide
from router.policy.pd_pick import DecodeLoad
from router.pool.worker_state import WorkerState
from router.request.placement import role_of


@dataclass(frozen=True)
class Seen:
    """What one plan reads of the cluster, once: each worker's cached match of the prompt and
    the share of its time it lately spent on prompts (healthy workers only)."""

    matches: Mapping[WorkerId, PrefixMatch]
    shares: Mapping[WorkerId, float]

    def held(self, worker: WorkerId) -> int:
        match = self.matches.get(worker)
        return 0 if match is None else match.num_blocks


def prefill_side(
    state: WorkerState, num_tokens: int, held_blocks: int, block_size: int, prefetch: bool
) -> PrefillSide:
    """`state`'s worker computing a prompt of `num_tokens` it holds `held_blocks` of; with
    `prefetch` (the decode worker pulls while it runs), the chunk it computes a step."""
    streams = 0 if role_of(state) == PREFILL else state.load.num_running  # a mixed worker's
    info = state.info  # its chunk: what an early pull moves before the token
    chunk = info.step_tokens if prefetch and info is not None else None
    uncached = max(0, num_tokens - held_blocks * block_size)
    per_token = prefill_token_s(state.load.block_costs, block_size)
    return PrefillSide(
        state.worker_id, uncached, state.num_queued_tokens, per_token, streams, chunk
    )


def decode_side(
    state: WorkerState, num_tokens: int, matched_blocks: int, block_size: int, seen: Seen
) -> DecodeSide:
    """`state`'s worker where a prompt of `num_tokens` it holds `matched_blocks` of runs
    colocated, or decodes."""
    costs = state.load.block_costs
    pull_s = None if costs is None else costs.fetch_s.get(PEER)
    return DecodeSide(
        state.worker_id,
        max(0, num_tokens - matched_blocks * block_size),
        state.num_queued_tokens,
        state.load.num_running,
        prefill_token_s(costs, block_size),
        pull_s,
        seen.shares.get(state.worker_id, 0.0),
    )


def decode_load(state: WorkerState, seen: Seen) -> DecodeLoad:
    """`state`'s worker as `pick_decode` sees it."""
    hbm = state.load.blocks.get("hbm")
    free = 0 if hbm is None else hbm.total - hbm.used
    return DecodeLoad(
        state.worker_id,
        state.load.num_running,
        state.num_requests - state.load.num_running,
        free,
        state.num_queued_tokens,
        seen.shares.get(state.worker_id, 0.0),
    )
