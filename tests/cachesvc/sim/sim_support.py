"""What the simulator's tests share: a cost profile whose clock is easy to reason about."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cachesvc.kv.planner import ComputeCost
from cachesvc.sim.cost_profile import CostProfile, DecodeCost, TierReadCost

# A millisecond per prompt token and per decoding sequence, whole prompts in one step; a pull
# of a run takes a millisecond plus a nanosecond per byte (a block of this profile is a few
# hundred bytes); landing and the holder's staging are free.
UNIT = CostProfile(
    name="unit",
    description="test clock",
    kv_bytes_per_token=1.0,
    prefill=ComputeCost(alpha_s=0.0, beta_s=1e-3, gamma_s=0.0),
    decode=DecodeCost(base_s=0.0, per_seq_s=1e-3, per_context_token_s=0.0),
    peer=TierReadCost(1e-3, 1e-9),
    max_num_batched_tokens=10**7,
    max_num_seqs=10**4,
)

WriteTrace = Callable[[list[tuple[float, int, int, list[int]]]], Path]  # conftest's write_trace
