"""The simulator's clock: a cost profile of one worker's device, stored as a JSON file.

A profile predicts how long one engine step takes from what it computes, and how long a fetch
from a lower tier takes from what it reads:

    step_s        = alpha + beta * sum(k) + gamma * sum(k * (ctx + k / 2))       (prefill chunks)
                    + per_seq * num_decodes + per_context_token * sum(decode ctx) (decode tokens)
    decode step   = by_batch[B] + per_context_token * sum(decode ctx)           (no prefill chunk)
    by_batch[B]   = measured for small B, else base + per_seq * B
    read(tier, n) = latency + n * bytes_per_block * seconds_per_byte
    pull(n)       = peer.latency + n * bytes_per_block * peer.seconds_per_byte     (from a holder)
    land(n)       = n * bytes_per_block * land_s_per_byte                          (into the device)

A live deployment adds six terms to the engine's own times (`calibrate_live` measures them
through a real router and Ray workers; a profile of the device alone leaves them at zero):

    live step     = (step_s * (1 + prefill_overhead_share) + prefill_overhead
                        (these two in a step with prompt tokens)
                     + step_overhead + token_overhead * sequences in the step)
                    * (1 + contention * other workers stepping)
    client's TTFT = the engine's TTFT + hop                  (its tokens' gaps are unchanged)

and one spread: a live step is rarely its median (the collector, the event loop, the host's
other work), so a simulated worker adds to each step a draw from `step_jitter_s`, quantiles of
how much longer than their median a lone stream's live gaps were (`jitter.StepJitter`; none in a
profile of the device alone). Without it a replay's inter-token p99 is its p50.

The prefill terms are the planner's own `ComputeCost`, and the tier terms its `TierCost`: the
simulated workers plan fetches with the same cost model their time comes from. A pull from
another worker moves raw blocks (`bytes_per_block` of the device's layout); its cost defaults to
the live worker's prior (`calibration.DEFAULT_TIER_COSTS["peer"]`) where a profile does not say.
Profiles live in `cachesvc/sim/profiles/` (`list_profiles`); `cachesvc simulate calibrate`
writes one measured on this machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachesvc.kv.calibration import DEFAULT_TIER_COSTS
from cachesvc.kv.planner import ComputeCost, CostModel, TierCost
from router.policy.routing import PEER

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class DecodeCost:
    """A decode-only step: a fixed cost (`base_s`), then per sequence its token and the reading
    of its context's KV. Where `by_batch_s` holds a measured step of that many sequences (at a
    short context), it replaces the first two: a CPU's matrix kernels make small batches far
    from linear (here 2 and 3 sequences step slower than 4)."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float
    by_batch_s: tuple[float, ...] = ()  # [B - 1]: a step of B sequences

    def step_s(self, num_seqs: int, sum_context: int) -> float:
        if 0 < num_seqs <= len(self.by_batch_s):
            fixed = self.by_batch_s[num_seqs - 1]
        else:
            fixed = self.base_s + self.per_seq_s * num_seqs
        return fixed + self.per_context_token_s * sum_context

    def scaled(self, factor: float) -> DecodeCost:
        return DecodeCost(
            self.base_s * factor,
            self.per_seq_s * factor,
            self.per_context_token_s * factor,
            tuple(s * factor for s in self.by_batch_s),
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DecodeCost:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"decode: {sorted(unknown)}")
        return cls(
            float(data["base_s"]),
            float(data["per_seq_s"]),
            float(data["per_context_token_s"]),
            tuple(float(s) for s in data.get("by_batch_s", ())),
        )


@dataclass(frozen=True)
class TierReadCost:
    """One lower tier's read: a fixed latency per run, then per byte."""

    latency_s: float
    seconds_per_byte: float

    @property
    def bytes_per_s(self) -> float:
        return 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class CostProfile:
    """One worker's device and tiers, as the simulator's clock (see the module docstring)."""

    name: str
    description: str
    kv_bytes_per_token: float
    prefill: ComputeCost
    decode: DecodeCost
    tiers: Mapping[str, TierReadCost] = field(default_factory=dict)
    land_s_per_byte: float = 0.0
    # A pull of a run of blocks from a holder.
    peer: TierReadCost = TierReadCost(*DEFAULT_TIER_COSTS["peer"])
    # What serving a pull costs the holder: its engine stages each byte sent between two steps
    # (a gather into a host buffer), so its next step takes that much longer.
    stage_s_per_byte: float = 0.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # The live path (see the module docstring): a request's trip from the client through the
    # router and Ray to the engine and its first token's trip back; the worker's own work
    # between two steps (streaming a step's outputs); and how much longer a step takes for
    # each other worker stepping on the same host (they share its cores and the router's).
    hop_s: float = 0.0
    step_overhead_s: float = 0.0
    token_overhead_s: float = 0.0  # per sequence in the step: its output streamed
    # A live worker's step with prompt tokens takes this much longer than the engine's alone,
    # and this share of the engine's step more (measured at 16 to 128 new tokens, the extra
    # grows with the step: a share, not only a constant).
    prefill_overhead_s: float = 0.0
    prefill_overhead_share: float = 0.0
    contention: float = 0.0
    # Quantiles at evenly spaced probabilities (0, 1/n, ..., 1) of a live step's time less the
    # median of its kind (s; the low ones below zero): what a step draws on top (`jitter`).
    step_jitter_s: tuple[float, ...] = ()
    source: str = ""  # where the numbers come from: a measurement, or published figures

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"profile {self.name}: kv_bytes_per_token must be positive")
        if self.prefill.beta_s <= 0:
            raise ValueError(f"profile {self.name}: prefill.beta_s must be positive")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"profile {self.name}: step limits must be positive")
        live = (
            self.hop_s,
            self.step_overhead_s,
            self.token_overhead_s,
            self.prefill_overhead_s,
            self.prefill_overhead_share,
        )
        if min(*live, self.contention) < 0:
            raise ValueError(f"profile {self.name}: the live path's terms must be >= 0")
        if list(self.step_jitter_s) != sorted(self.step_jitter_s):
            raise ValueError(f"profile {self.name}: step_jitter_s must be ascending quantiles")

    def engine_step_s(
        self, chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """Seconds of one `Engine.step` computing prefill `chunks` of (new tokens, context) and
        one token of each sequence decoding after `decode_contexts` tokens."""
        c, d = self.prefill, self.decode
        if not chunks:
            return d.step_s(len(decode_contexts), sum(decode_contexts))
        k = sum(n for n, _ in chunks)
        attention = sum(n * (ctx + n / 2) for n, ctx in chunks)
        return (
            c.alpha_s
            + c.beta_s * k
            + c.gamma_s * attention
            + d.per_seq_s * len(decode_contexts)
            + d.per_context_token_s * sum(decode_contexts)
        )

    def step_s(
        self,
        chunks: Sequence[tuple[int, int]],
        decode_contexts: Sequence[int],
        others_stepping: int = 0,
    ) -> float:
        """Seconds of that step on a live worker, from one step's start to the next's, while
        `others_stepping` other workers of its host step too."""
        engine_s = self.engine_step_s(chunks, decode_contexts)
        if chunks:
            engine_s = engine_s * (1 + self.prefill_overhead_share) + self.prefill_overhead_s
        streamed = self.token_overhead_s * (len(chunks) + len(decode_contexts))
        live_s = engine_s + self.step_overhead_s + streamed
        return live_s * (1 + self.contention * others_stepping)

    def slowed(self, factor: float) -> CostProfile:
        """The same device `factor` times slower at computing (and at the live path's CPU
        work): a machine that other work shares (`calibrate.measure_slowdown`)."""
        c = self.prefill
        return dataclasses.replace(
            self,
            prefill=ComputeCost(c.alpha_s * factor, c.beta_s * factor, c.gamma_s * factor),
            decode=self.decode.scaled(factor),
            hop_s=self.hop_s * factor,
            step_overhead_s=self.step_overhead_s * factor,
            token_overhead_s=self.token_overhead_s * factor,
            prefill_overhead_s=self.prefill_overhead_s * factor,
            step_jitter_s=tuple(q * factor for q in self.step_jitter_s),
        )

    def cost_model(self, block_size: int, peer_pull: bool = False) -> CostModel:
        """The planner's cost model for blocks of `block_size` tokens; with `peer_pull`, pulls
        from a holder are one more tier (`PEER`)."""
        block_bytes = self.kv_bytes_per_token * block_size
        reads = {**self.tiers, PEER: self.peer} if peer_pull else self.tiers
        tiers = {
            name: TierCost(t.latency_s, t.seconds_per_byte, block_bytes)
            for name, t in reads.items()
        }
        return CostModel(self.prefill, tiers, self.land_s_per_byte * block_bytes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostProfile:
        """A profile from its JSON form; a missing or unknown key is a ValueError naming it."""
        try:
            return cls(
                name=str(data["name"]),
                description=str(data.get("description", "")),
                kv_bytes_per_token=float(data["kv_bytes_per_token"]),
                prefill=ComputeCost(**{k: float(v) for k, v in data["prefill"].items()}),
                decode=DecodeCost.from_json(data["decode"]),
                tiers={
                    name: TierReadCost(**{k: float(v) for k, v in t.items()})
                    for name, t in data.get("tiers", {}).items()
                },
                land_s_per_byte=float(data.get("land_s_per_byte", 0.0)),
                peer=TierReadCost(**{k: float(v) for k, v in data["peer"].items()})
                if "peer" in data
                else TierReadCost(*DEFAULT_TIER_COSTS["peer"]),
                stage_s_per_byte=float(data.get("stage_s_per_byte", 0.0)),
                max_num_batched_tokens=int(data.get("max_num_batched_tokens", 8192)),
                max_num_seqs=int(data.get("max_num_seqs", 256)),
                hop_s=float(data.get("hop_s", 0.0)),
                step_overhead_s=float(data.get("step_overhead_s", 0.0)),
                token_overhead_s=float(data.get("token_overhead_s", 0.0)),
                prefill_overhead_s=float(data.get("prefill_overhead_s", 0.0)),
                prefill_overhead_share=float(data.get("prefill_overhead_share", 0.0)),
                contention=float(data.get("contention", 0.0)),
                step_jitter_s=tuple(float(q) for q in data.get("step_jitter_s", ())),
                source=str(data.get("source", "")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a cost profile: missing or unknown key {exc}") from exc


def list_profiles() -> list[str]:
    """Names of the profiles stored in the repository."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> CostProfile:
    """A stored profile by name (`list_profiles`), or a profile file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"no cost profile {name_or_path!r}; stored ones: {list_profiles()}")
    return CostProfile.from_json(json.loads(path.read_text()))


def save_profile(profile: CostProfile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n")
