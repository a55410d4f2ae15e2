"""The engine's side of the KV tiers (`KVTiering`): plan loads from the tiers and peers, land
them, and answer the KV manager's and the step loop's hooks (it sets the pool's too).

* Load: when a waiting request's device prefix match ends, the following hashes are looked up in
  the tiers and the planner decides. A fetch is read at once (from DRAM, straight out of its
  slots) into freshly allocated device blocks, registered, and counted as cached. A split
  (Cake) starts the fetch of the back part on a background thread while the scheduler computes
  the front part; when the front is computed up to the split point (`on_computed`), the fetched
  blocks land and the request jumps ahead.
  Whatever fails to read back (a miss, a corrupt blob) is simply computed.
  A peer worker holding more of the prompt (`peer.pull.PeerSource`, from the router's hint) is
  one more source after the local tiers: its pull always runs in the background, so the engine
  keeps stepping; a fetch that waits on it computes nothing until it lands (`land_ready`).

Beside it: `startup` builds the tiers and the cost model's priors, `pending_loads` holds the
loads under way, `landing` writes fetched blocks into the device, `writes` copies
blocks down (demoted on eviction, shared once popular), `usage` counts each request's
prompt tokens per tier, `lossy` marks the device KV that came from a quantized tier (or was
computed over it) and the requests that used it, `metrics` keeps the counters and flattens them
for an endpoint.

Only the engine's thread touches the device tensors and the manager's state; the background
thread only reads tiers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.codec import DTYPES
from cachesvc.kv.config import TierConfig
from cachesvc.kv.planner import FetchRange, LoadPlan, plan_load
from cachesvc.kv.tiers.base import Throttle
from cachesvc.kv.tiers.results import FetchResult, TierHit
from cachesvc.kv.types import BlockHash, RequestId
from workers.engine.request import Request
from workers.engine.scheduler import SchedulerOutput
from workers.engine.tiering.landing import borrowed, land_blocks, trim_blocks
from workers.engine.tiering.lossy import LossyKV
from workers.engine.tiering.metrics import TieringStats, tiering_metrics
from workers.engine.tiering.peer import ChunkCheck, PeerLink, PeerPuller, is_peer
from workers.engine.tiering.pending_loads import (
    PendingLoad,
    PendingLoads,
    PendingPull,
    Ranges,
    local_ranges,
)
from workers.engine.tiering.plan_timing import PlanTimer
from workers.engine.tiering.startup import build_manager, prior_costs
from workers.engine.tiering.usage import TierUsage
from workers.engine.tiering.writes import TierWriter
from workers.protocol import BlockCosts
from workers.transfer.chunk import chunk_key

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LoadTiming:
    """The last fetched run that landed: its KV bytes, the reads (tier get + decode, overlapped
    with compute in a split) and the copy into the device caches (on the request's path)."""

    num_blocks: int
    num_bytes: int
    read_s: float
    land_s: float


class KVTiering:
    """Implements the KV manager's `TieringHooks`; sets the pool's eviction hook (`TierWriter`)."""

    def __init__(
        self,
        config: TierConfig,
        pool: BlockPool,
        kv_caches: list[torch.Tensor],
        block_size: int,
        fingerprint: str,
        key: bytes | None,
    ) -> None:
        """`key`: the deployment's tier key (`TierConfig.read_key`, read once at the engine's
        start), signing what leaves the process."""
        self.config = config
        self.pool = pool
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.dtype = _DTYPE_NAMES[kv_caches[0].dtype]
        self.block_shape = (len(kv_caches), *kv_caches[0].shape[1:])
        self.manager = build_manager(config, pool, fingerprint, self.dtype, self.block_shape, key)
        self.costs = prior_costs(config, self.manager, self.dtype, self.block_shape)
        self.mode = config.plan  # "auto", or forced (tests, benchmarks)
        self.stats = TieringStats()
        self.last_plan: LoadPlan | None = None
        self.last_load: LoadTiming | None = None
        self.timer = PlanTimer()
        self._pending = PendingLoads()
        self._usage = TierUsage(block_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fetch")
        self._key = key
        self.lossy = LossyKV(pool)
        self.peers: PeerPuller | None = None  # see `attach_peers`
        self._writer = TierWriter(self.manager, pool, kv_caches, self.dtype)
        pool.on_evict = self._writer.on_evict

    def attach_peers(self, link: PeerLink, timeout_s: float, digest: str) -> None:
        """Plan pulls from the peers that requests name (`Request.peer`) through `link`;
        chunks are checked with `digest` ("fast" or "strict", as the peers seal them)."""
        check = ChunkCheck(chunk_key(self._key), digest, self.fingerprint, self.block_shape)
        size = int(np.prod(self.block_shape)) * DTYPES[self.dtype][1].itemsize
        self.peers = PeerPuller(link, check, self.costs, size, timeout_s)

    # ---- loading ----------------------------------------------------------------------------

    def extend_match(
        self, request: Request, hashes: Sequence[BlockHash], num_device_blocks: int, max_blocks: int
    ) -> int:
        d = num_device_blocks
        self._writer.note_reuse(list(hashes[:d]), request.block_ids, None)
        self._usage.start(request.request_id, d)
        room = self.pool.num_free - 1  # keep a block for the token that must be computed
        end = min(max_blocks, d + room)
        if end <= d:
            return 0
        hits = [TierHit(h.tier, h.start + d, h.end + d) for h in self.manager.lookup(hashes[d:end])]
        peer = self._peer_hit(request, hits[-1].end if hits else d, end)
        if peer is not None:
            hits.append(peer)
        if not hits:
            return 0
        plan = plan_load(
            hits, d, request.num_tokens, self.block_size, self.costs.model(), self.mode
        )
        self.last_plan = plan
        self.stats.plans[plan.kind] = self.stats.plans.get(plan.kind, 0) + 1
        self.timer.start(request, plan)
        if plan.kind in ("none", "recompute"):
            return 0
        ranges: Ranges = [(f.tier, list(hashes[f.start : f.end])) for f in plan.fetch]
        self.manager.pin(local_ranges(ranges))
        # Allocating may evict (and demote) device blocks: the pins keep the planned ones put.
        request.block_ids.extend(self.pool.allocate(plan.fetch_end - d))
        pulled = [f for f in plan.fetch if is_peer(f.tier)]
        if pulled:
            return self._start_pull(request, plan, ranges, pulled[0])
        if plan.kind == "split":
            future = self._executor.submit(self.manager.read, ranges)
            return self._pend(request, plan, ranges, future)
        # They land at once: read into the tiers' views, not fresh buffers.
        with borrowed(self.manager, ranges):
            result = self.manager.read(ranges)
            self.manager.unpin(ranges)
            num_loaded = self._land(request, result, d, ranges)
        trim_blocks(self.pool, request, self.block_size)
        return num_loaded * self.block_size

    def num_joined_blocks(
        self, request: Request, hashes: Sequence[BlockHash], num_device_blocks: int
    ) -> int:
        """How many blocks after the request's device prefix pulls in flight for other
        requests bring (0 for a request without a peer: it never waits on a pull). A request
        with some waits for those pulls to land rather than pull the same blocks again."""
        if request.peer is None:
            return 0
        n = num_device_blocks
        while n < len(hashes) and self._pending.pulling(hashes[n]):
            n += 1
        return n - num_device_blocks

    def _peer_hit(self, request: Request, start: int, end: int) -> TierHit | None:
        """The run of the request's peer after block `start` (below `end`), when it has one."""
        source = request.peer
        if self.peers is None or source is None or min(source.num_blocks, end) <= start:
            return None
        return TierHit(self.peers.cost(source), start, min(source.num_blocks, end))

    def _start_pull(
        self, request: Request, plan: LoadPlan, ranges: Ranges, pulled: FetchRange
    ) -> int:
        """Start a plan that pulls from a peer: its local reads and the pull both in the
        background; the request computes up to the split (nothing, for a plain fetch) and
        waits there until both have arrived. Returns the tokens planned."""
        assert self.peers is not None and request.peer is not None
        future = self._executor.submit(self.manager.read, local_ranges(ranges))
        hashes = dict(ranges)[pulled.tier]
        pull = self.peers.submit(
            request.peer,
            list(request.prompt_token_ids),
            request.cache_salt,
            hashes,
            pulled.start,
        )
        n = pulled.end - pulled.start
        predicted = self.costs.model().tiers[pulled.tier].fetch_s(n)
        return self._pend(request, plan, ranges, future, PendingPull(pull, n, predicted))

    def _pend(
        self,
        request: Request,
        plan: LoadPlan,
        ranges: Ranges,
        future: Future[FetchResult],
        pull: PendingPull | None = None,
    ) -> int:
        """Hold a load submitted in the background until the request computes up to the
        split; returns the tokens planned."""
        split_token = plan.split_block * self.block_size
        load = PendingLoad(split_token, ranges, future, time.perf_counter(), plan.overlap_s, pull)
        self._pending.add(request.request_id, load)
        self._usage.planned(request.request_id, ranges, plan.num_fetch_blocks)
        return plan.num_fetch_blocks * self.block_size

    def _land(
        self,
        request: Request,
        result: FetchResult,
        first: int,
        ranges: Ranges,
        background: bool = False,
    ) -> int:
        """Write fetched blocks into the request's blocks from index `first`, register them and
        move its computed tokens past them; returns how many landed. `background`: the blocks
        were read while the engine computed (a split)."""
        self.manager.settle(result)
        for transfer in result.transfers:  # the tiers' reads; a pull is learned by the puller
            self.costs.observe_transfer(transfer, background)
        n = len(result.blocks)
        land_s = land_blocks(
            self.kv_caches, self.pool, request, result.blocks, first, self.block_size, self.dtype
        )
        self.costs.observe_land(n, land_s)
        read_s = sum(t.seconds for t in result.transfers)
        self.last_load = LoadTiming(n, sum(b.array.nbytes for b in result.blocks), read_s, land_s)
        planned = sum(len(hashes) for _, hashes in ranges)
        self.stats.loaded_blocks += n
        self.stats.failed_blocks += planned - n
        self._usage.landed(request.request_id, ranges, n)
        ids = request.block_ids[first : first + n]
        first_parent = request.block_hashes[first - 1] if first > 0 else None
        self._writer.note_reuse([b.block_hash for b in result.blocks], ids, first_parent)
        return n

    def num_computable(self, request: Request, num_left: int) -> int:
        return self._pending.num_computable(request, num_left)

    def on_computed(self, request: Request) -> None:
        self.timer.on_computed(request)
        self._land_due(request, wait=True)
        self.lossy.computed(request)

    def land_ready(self, request: Request) -> None:
        """Land the request's fetch if it is due and has arrived (a pull, which the engine
        does not wait for)."""
        self._land_due(request, wait=False)

    @torch.inference_mode()
    def _land_due(self, request: Request, wait: bool) -> None:
        """Land the request's fetch once it is due: waiting for local reads when `wait` (a
        split's back, Cake), never for a pull (it lands in `land_ready` once it arrived)."""
        pending = self._pending.due(request)
        if pending is not None and (pending.done() or (wait and pending.pull is None)):
            self._complete(request)

    def num_planned_tokens(self, request: Request) -> int:
        """Prompt tokens a planned fetch of the request is to bring: not work to compute."""
        return self._pending.num_planned_blocks(request.request_id) * self.block_size

    def awaits_load(self, request: Request) -> bool:
        """True while the request has nothing to compute before a planned fetch lands."""
        return self._pending.due(request) is not None

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a pending pull arrives, at most `timeout_s` (a step with nothing else
        to compute waits here instead of spinning)."""
        self._pending.wait(timeout_s)

    def _complete(self, request: Request) -> None:
        """Land a due fetch (waiting for its local reads, Cake); what missed is computed."""
        pending = self._pending.take(request.request_id)
        result = pending.future.result()  # the front is computed: wait for the back (Cake)
        waited = time.perf_counter() - pending.started
        if pending.pull is not None:
            read = pending.pull.future.result()
            assert self.peers is not None
            self.peers.settle(read, pending.pull.num_blocks, pending.pull.predicted_s)
            local = sum(len(h) for _, h in local_ranges(pending.ranges))
            if len(result.blocks) == local:  # the peer's run extends the local one
                result.blocks.extend(read.blocks)
        elif request.num_preemptions == 0:  # a preempted request's front computed twice
            self.costs.observe_overlap(result.transfers, waited - pending.overlap_s)
        self.manager.unpin(local_ranges(pending.ranges))
        first = pending.split_token // self.block_size
        landed = self._land(request, result, first, pending.ranges, background=True)
        missed = sum(len(h) for _, h in pending.ranges) - landed
        if missed and request.num_preemptions == 0:
            request.num_cached_tokens -= missed * self.block_size  # computed after all

    def release(self, request: Request) -> None:
        self.lossy.released(request)
        self.timer.drop(request.request_id)
        self.manager.unpin(self._pending.drop(request.request_id))

    # ---- the step hook, counters ------------------------------------------------------------

    @torch.inference_mode()
    def after_step(self, output: SchedulerOutput, seconds: float) -> None:
        """Learn the compute speed from the step; share queued blocks (their KV is now written)."""
        chunks = [(len(c.token_ids), c.start_pos) for c in output.chunks]
        # Only steps that compute some prompt teach the prefill cost: a decode-only step is
        # bound by reading the weights, not by its few tokens, and a window of them (a decode
        # worker's, or any worker's between prompts) once fit a 2K-token prefill at a quarter
        # of its cost. A step that mixes both is the cost of its mix, and stays in.
        if any(num_tokens > 1 for num_tokens, _ in chunks):
            self.costs.observe_compute(chunks, seconds)
        self._writer.share_queued()
        self.manager.poll()

    def set_cap(self, tier_name: str, mb_per_s: float | None) -> None:
        """Cap (None: uncap) a tier's read bandwidth from now on, for tests and benchmarks; the
        cost model adds the cap to what it learned of the tier."""
        self.manager.tier(tier_name).throttle = Throttle(mb_per_s)
        self.costs.set_cap(tier_name, mb_per_s)

    def metrics(self) -> dict[str, float]:
        """Flat counters for a metrics endpoint (`metrics.tiering_metrics`)."""
        return tiering_metrics(self.manager, self.stats, self.timer, self.peers)

    def block_costs(self) -> BlockCosts:
        """What a block costs this worker, for routing: recomputing it, and bringing it in
        from each tier and, with peers attached, from a peer ("peer": one figure, whichever
        the holder). Reads a snapshot of the cost model: safe while the engine steps."""
        model, bs = self.costs.model(), self.block_size
        fetch_s = {
            name: t.bytes_per_block * t.seconds_per_byte + model.land_s_per_block
            for name, t in model.tiers.items()
            if not is_peer(name)
        }
        if self.peers is not None:
            fetch_s["peer"] = self.peers.block_s(model)
        compute_s = bs * model.compute.beta_s + bs * bs / 2 * model.compute.gamma_s
        return BlockCosts(compute_s, fetch_s)

    def usage(self, request_id: RequestId) -> dict[str, int]:
        """Prompt tokens served from each tier ("hbm" for the device) for a request."""
        return self._usage.get(request_id)

    def lossy_kv(self, request_id: RequestId) -> bool:
        """Whether the request's answer came from lossy KV (a quantized tier's)."""
        return self.lossy.used(request_id)

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish background reads and writes, then close the tiers."""
        self._pending.drop_all()
        if self.peers is not None:
            self.peers.close()
        self._executor.shutdown(wait=True)
        self.manager.close()
