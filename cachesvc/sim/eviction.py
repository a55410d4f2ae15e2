"""`cachesvc simulate eviction`: replay a workload's prefix lookups through a block store of
a fixed size under each eviction policy, against Belady's offline optimum.

The store is the device pool's free queue without timing: a request looks up its prefix (a hit
is the run of leading blocks held, as the engine matches), takes its blocks out of the
evictable set while it runs (`pull`; the missing ones are stored, evicting victims from the
rest), then gives them all back tail first (`push`, each with its parent), as requests free
their blocks. Only full blocks are stored, and a hit stops before the block of the prompt's
last token, as in `SimRequest`. Sizes are a percentage of the workload's distinct blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cachesvc.kv.eviction.base import EvictionPolicy, make_policy
from cachesvc.kv.types import BlockHash
from cachesvc.sim.belady import Belady, ReuseOracle
from cachesvc.sim.generate import GeneratedTrace, generate_rows
from cachesvc.sim.trace import (
    SimRequest,
    load_trace,
    num_unique_blocks,
    oracle_hit_blocks,
    trace_requests,
)

BELADY = "belady"
REUSE_ORACLE = "reuse_oracle"  # LRU that knows which blocks are never used again
ORACLES = (REUSE_ORACLE, BELADY)
UNBOUNDED = "unbounded"  # a store holding every block: the most any policy could hit
WORKLOADS = ("trace", "multi-turn", "mixed")
# Generated workloads are drawn for a cluster of this many workers (0.5 requests per second
# each for 300 s): thousands of requests, of conversations that outlive many others' turns.
GENERATED_WORKERS = 16


@dataclass(frozen=True)
class ReplayResult:
    """One policy on one workload at one size."""

    workload: str
    policy: str
    size_pct: float
    capacity_blocks: int
    hit_blocks: int
    lookup_blocks: int  # blocks a hit could have covered

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_ratio": self.hit_ratio, "hit_pct": 100 * self.hit_ratio}


def workload_requests(name: str, trace: str | None, max_requests: int | None) -> list[SimRequest]:
    """The requests of workload `name` (one of WORKLOADS): the Mooncake trace at `trace`, or a
    generated one: conversations only (`multi-turn`: turns that grow a history after one of a
    few shared system prompts) or conversations and agents (`mixed`)."""
    if name == "trace":
        if trace is None:
            raise ValueError("the trace workload needs a trace file (--trace)")
        return load_trace(trace, max_requests=max_requests)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    shape = GeneratedTrace(agent_fraction=0.0 if name == "multi-turn" else 0.4)
    return trace_requests(generate_rows(shape, GENERATED_WORKERS)[:max_requests])


def replay(requests: Sequence[SimRequest], policy: EvictionPolicy[BlockHash], capacity: int) -> int:
    """Blocks hit over the replay of `requests` through a store of `capacity` blocks ordered
    by `policy` (which it mutates)."""
    held: set[BlockHash] = set()
    belady = policy if isinstance(policy, Belady) else None
    hits = 0
    for index, r in enumerate(requests):
        blocks = r.hashes[: r.num_full_blocks]
        n = 0
        while n < r.max_match_blocks and r.hashes[n] in held:
            n += 1
        hits += n
        used: list[int] = []  # positions of the blocks this request holds while it runs
        for i, h in enumerate(blocks):
            if h in held:
                policy.pull(h)
            elif len(held) < capacity or len(policy):
                if len(held) >= capacity:
                    held.discard(policy.pop())
                held.add(h)
            else:
                continue  # every block held is in use: this one is not stored
            used.append(i)
        if belady is not None:
            belady.begin(index, r)
        for i in reversed(used):
            policy.push(blocks[i], blocks[i - 1] if i else None)
    return hits


def run_eviction(
    workloads: dict[str, list[SimRequest]], sizes_pct: Sequence[float], policies: Sequence[str]
) -> list[ReplayResult]:
    """Every policy (and the oracles, Belady last) on every workload at every size; sizes in
    percent of the workload's distinct blocks (at least one block). Each workload also has an
    `UNBOUNDED` result at 100%."""
    out = []
    for name, requests in workloads.items():
        unique = num_unique_blocks(requests)
        lookups = sum(r.max_match_blocks for r in requests)
        hits = sum(oracle_hit_blocks(requests))
        out.append(ReplayResult(name, UNBOUNDED, 100.0, unique, hits, lookups))
        for pct in sizes_pct:
            capacity = max(1, round(unique * pct / 100))
            for policy in (*policies, *ORACLES):
                store = _store(policy, requests)
                hits = replay(requests, store, capacity)
                out.append(ReplayResult(name, policy, pct, capacity, hits, lookups))
    return out


def _store(policy: str, requests: Sequence[SimRequest]) -> EvictionPolicy[BlockHash]:
    """A new store's policy: an oracle reading `requests`' future, or a policy by name."""
    if policy == BELADY:
        return Belady(requests)
    if policy == REUSE_ORACLE:
        return ReuseOracle(requests)
    return make_policy(policy)
