"""The messages between the router and a worker: the router's whole view of one.

Everything that crosses the process boundary is a plain frozen dataclass (no proto, torch or Ray
types), so the router imports this module without importing torch or ray. The KV events and the
index snapshot they carry are the cache core's (`cachesvc.kv.events`, `cachesvc.kv.index`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cachesvc.kv.events import Event
from cachesvc.kv.quotas import TenantBlocks as TenantBlocks
from cachesvc.kv.quotas import TenantQuota as TenantQuota


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker is; fixed for its lifetime (one incarnation)."""

    worker_id: str
    incarnation: str
    model_fingerprint: str
    block_size: int
    vocab_size: int
    max_model_len: int
    device: str
    event_stream: str | None = None  # the Redis Stream it publishes its events to, if any
    actor_name: str | None = None  # its Ray actor's name, for peers to pull blocks from it
    node_id: str | None = None  # the Ray node it runs on (None outside Ray)
    node_ip: str | None = None  # that node's IP address
    role: str = "mixed"  # its engine config's role (`EngineConfig.role`): a routing preference
    step_tokens: int | None = None  # the most prompt tokens it computes a step (its chunk)


@dataclass(frozen=True)
class Heartbeat:
    """A worker's answer to a ping, from a thread of its own (never behind a step): how long
    its engine has been inside the step running now (`step_s`, 0.0 between steps) and how long
    its event loop has not turned (`loop_stall_s`). Long steps are normal; a stall far longer
    than any step is a hang."""

    incarnation: str
    step_s: float
    loop_stall_s: float

    @property
    def stalled_s(self) -> float:
        return max(self.step_s, self.loop_stall_s)


@dataclass(frozen=True)
class TierBlocks:
    total: int
    used: int  # held by running requests
    cached: int  # registered under a hash


@dataclass(frozen=True)
class BlockCosts:
    """What one block costs a worker, in seconds, from its calibrated cost model
    (`cachesvc.kv.planner`): recomputing it (`compute_s`, the marginal prefill time of a block's
    tokens), and bringing it into the device from each lower tier (`fetch_s`, by tier name: its
    read and its copy in, per block of a long fetch)."""

    compute_s: float
    fetch_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerLoad:
    """How busy a worker is; `num_queued_tokens` is the work ahead of a new request."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    blocks: Mapping[str, TierBlocks] = field(default_factory=dict)
    # The lower tiers' counters (`KVTiering.metrics`): reads, misses, plans and their timing.
    tiering: Mapping[str, float] = field(default_factory=dict)
    # Per-block costs for routing; None when the worker has no lower tiers (nor a cost model).
    block_costs: BlockCosts | None = None


@dataclass(frozen=True)
class PollResult:
    """The worker's load and its KV events with `seq >= since`, oldest first; `next_seq`
    numbers the next event it will make (every earlier one is buffered or published)."""

    incarnation: str
    load: WorkerLoad
    events: tuple[Event, ...]
    next_seq: int = 0


@dataclass(frozen=True)
class HolderHint:
    """A worker that holds a longer prefix of a request than the one chosen to run it: the
    name of its Ray actor (in the chosen worker's namespace) and how many leading blocks of the
    prompt it holds. The chosen worker may pull the blocks it lacks from it. `handoff`: the
    holder computed the prompt for this very request (prefill/decode disaggregation) and keeps
    it, so the chosen worker's copy is the first to be evicted once the request ends."""

    actor_name: str
    num_blocks: int
    handoff: bool = False


# The key of `Usage.cached_tokens` for prompt tokens whose KV was pulled from another worker
# (the worker's own tiers are named by tier: "hbm", "dram", "nvme", "redis").
PEER_TOKENS = "peer"


@dataclass(frozen=True)
class Usage:
    """What one sample's prompt cost and where it came from.

    The prompt splits three ways: `cached_tokens` (read from the cache, per tier),
    `cache_write_tokens` and the rest, uncached (`uncached_tokens`): read + written +
    uncached == `prompt_tokens`. Written: the full blocks of the prompt this request computed
    and registered in its worker's device pool under a hash the pool did not hold (so later
    requests can hit them). Uncached: the partial last block, and full blocks it computed that
    it could not register (another request of the same step registered them first, or prefix
    caching is off). `computed_tokens` is work, not accounting: a recompute after a preemption
    counts again, while the split is the first admission's.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Mapping[str, int]  # per tier
    computed_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float | None
    worker_id: str
    from_response_cache: bool = False  # answered by the router's response cache, no worker
    # Some of the prompt's KV came from a lossy, quantized tier (int8 / fp8): the answer may
    # differ from a fresh computation's, so the response cache never stores it.
    lossy_kv: bool = False
    # Prefill/decode disaggregation: the worker that computed the prompt (None: `worker_id`
    # did) and the prompt tokens whose KV the decoding worker pulled from it.
    prefill_worker_id: str | None = None
    kv_transfer_tokens: int = 0
    cache_write_tokens: int = 0
    # Prompt tokens now retained for this request (full blocks under its retention), and the
    # tokens it asked to retain that its tenant's retention budget trimmed.
    retained_tokens: int = 0
    retention_trimmed_tokens: int = 0

    @property
    def cache_read_tokens(self) -> int:
        """Prompt tokens read from the cache, all tiers."""
        return sum(self.cached_tokens.values())

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens neither read from the cache nor written to it."""
        return self.prompt_tokens - self.cache_read_tokens - self.cache_write_tokens


@dataclass(frozen=True)
class CacheHints:
    """A request's explicit cache controls, as the router passes them to its worker.

    `retention_s` > 0 retains the prompt's full blocks (the leading `retention_tokens` of it, or
    all when None) for that long, soft (`cachesvc.kv.retention`), against `tenant`'s budget;
    `session_id` tags them so that closing the session demotes them. `skip_read`: reuse no
    cached KV for the prompt; `skip_write`: register none of what it computes.
    """

    retention_s: int = 0
    retention_tokens: int | None = None
    tenant: str = ""
    session_id: str | None = None
    skip_read: bool = False
    skip_write: bool = False


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one sample; `finish_reason` and `usage` are set on its last delta."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # on a last delta: the stop string that ended the sample


@dataclass(frozen=True)
class StreamError:
    """A request the worker refused; `code` is invalid_argument | resource_exhausted |
    unimplemented, or internal: the engine failed while serving this request alone; or, through
    a mux only, unavailable: the worker failed the stream (the router retries it elsewhere)."""

    code: str
    message: str


# One item of a worker's mux (`workers/mux.py`): (the router's key of a stream, its next item),
# in order; None is the stream's end.
MuxBatch = list[tuple[int, StreamDelta | StreamError | None]]
