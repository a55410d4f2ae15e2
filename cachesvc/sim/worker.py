"""One simulated worker: the engine's scheduling over a real `BlockPool`, without a model.

It follows `workers/engine` step for step, with time from a `CostProfile` instead of a forward
pass: each step schedules running requests first (decodes and prefill chunks), then admits
waiting ones in arrival order within the token budget; blocks are allocated per chunk and a
request's full prompt blocks are registered when scheduled (so a request admitted in the same
step shares them); when blocks run out the newest running request is preempted and recomputed
later. A waiting request's match walks the pool, then, with lower tiers or pulls from other
workers, the real `TierManager` and planner decide what to load (`loads`). A request
whose pull has not arrived computes nothing but holds its place among the running ones, as in
the engine; the event loop wakes an idle worker when its first pull arrives (`next_pull_s`).

Every change of what the worker holds is an event in its `EventLog`, which the event loop feeds
to the router's prefix index. Each output token's time is kept on its request
(`SimSeq.token_times`); a worker's role only says what the router sends it (`pd`).

Time is a live worker's (`CostProfile.step_s`): each step pays the worker's own work between
steps, and, on a `Host` its cluster shares, is slower for each other worker stepping when it
starts. A token is timed when its client sees it, the profile's `hop_s` after its step; a
hand-off's decode waits that long too (the router passes it on) before its pull can land.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.events import TIER_HBM, EventLog
from cachesvc.kv.types import BlockHash, BlockId, WorkerId
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.jitter import StepJitter
from cachesvc.sim.loads import SimLoads
from cachesvc.sim.seq import SimSeq
from cachesvc.sim.tier import build_manager, stand_in_block
from cachesvc.sim.trace import BLOCK_SIZE, SimRequest
from router.policy.pd import MIXED
from router.policy.stream_gaps import RecentGaps
from workers.protocol import BlockCosts


class Host:
    """The machine a cluster's workers share: when each one's step under way ends, so that a
    step is priced with the others stepping at its start (`CostProfile.contention`)."""

    def __init__(self) -> None:
        self._step_ends: dict[WorkerId, float] = {}

    def others_stepping(self, worker_id: WorkerId, now: float) -> int:
        return sum(1 for w, end in self._step_ends.items() if w != worker_id and end > now)

    def stepping(self, worker_id: WorkerId, until: float) -> None:
        self._step_ends[worker_id] = until


class SimWorker:
    """A worker's scheduler, block pool and tiers; `start_step` and `finish_step` bracket one
    engine step, which the event loop times."""

    def __init__(
        self,
        worker_id: WorkerId,
        profile: CostProfile,
        num_blocks: int,
        dram_blocks: int = 0,
        nvme_blocks: int = 0,
        block_size: int = BLOCK_SIZE,
        peer_pull: bool = False,
        role: str = MIXED,
        host: Host | None = None,
    ) -> None:
        self.worker_id = worker_id
        # Only a profile with contention needs to know who else steps.
        self.host = host if profile.contention > 0 else None
        self.role = role  # what the router sends it (`router.policy.pd`): it schedules any request
        self.block_size = block_size
        self.profile = profile
        self.events = EventLog()
        self.pool = BlockPool(num_blocks, self.events)
        self.tiers = build_manager(dram_blocks, nvme_blocks, self.events, self.pool.contains)
        if self.tiers is not None:
            self.pool.on_evict = self._demote
        self.peer_pull = peer_pull  # plan pulls from the holders the router names
        self.cost = profile.cost_model(self.block_size, peer_pull)
        self.loads = SimLoads(
            self.pool, self.tiers, self.cost, block_size, peer_pull, profile.stage_s_per_byte
        )
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.busy_s = 0.0
        self.export_s = 0.0  # of it, staging pulls for other workers
        self.num_steps = 0
        self._step: list[tuple[SimSeq, int]] = []
        # Landing a load after a step (and waiting for a split's read) delays the next one.
        self._carry_s = 0.0
        self._jitter = StepJitter(profile.step_jitter_s, f"step jitter {worker_id}")
        # Its streams' recent gaps between tokens, timed when admission refuses on them.
        self.gaps: RecentGaps | None = None

    # ---- what the router sees ---------------------------------------------------------------

    def fits(self, req: SimRequest) -> bool:
        """Whether the request could ever run here (its whole sequence fits the pool)."""
        return -(-(req.prompt_len + req.output_len) // self.block_size) <= self.pool.num_blocks

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute (`EngineLoad.num_queued_tokens`): a waiting request's
        prefix on the device is not work."""
        waiting = sum(
            s.num_tokens - min(s.routed_blocks * self.block_size, s.num_tokens - 1)
            for s in self.waiting
        )
        return waiting + sum(s.num_tokens - s.computed for s in self.running)

    @property
    def plans(self) -> Counter[str]:
        """The planner's choices so far, by kind."""
        return self.loads.plans

    def block_costs(self) -> BlockCosts | None:
        """Per-block costs from the cost model, as a real worker with tiers or pulls reports
        them in its poll (`WorkerActor._load`: a pull under "peer"); None with neither."""
        if self.tiers is None and not self.peer_pull:
            return None
        c, bs = self.cost.compute, self.block_size
        return BlockCosts(
            compute_s=bs * c.beta_s + bs * bs / 2 * c.gamma_s,
            fetch_s={
                name: t.bytes_per_block * t.seconds_per_byte + self.cost.land_s_per_block
                for name, t in self.cost.tiers.items()
            },
        )

    def num_held(self, hashes: Sequence[BlockHash]) -> int:
        """Leading `hashes` held on the device or in a local tier: what a pull gets here."""
        n, tiers = 0, self.tiers
        for h in hashes:
            if not self.pool.contains(h) and (tiers is None or not tiers.held_locally(h)):
                break
            n += 1
        return n

    def charge(self, seconds: float) -> None:
        """Serving a pull: its staging lengthens this worker's next step; an idle worker's
        staging delays nobody, but it is busy all the same."""
        self.export_s += seconds
        if self.has_work:
            self._carry_s += seconds  # counted in busy_s with the step it lengthens
        else:
            self.busy_s += seconds

    def add(self, seq: SimSeq) -> None:
        self.waiting.append(seq)

    @property
    def next_pull_s(self) -> float | None:
        """When the first pull a running request waits for arrives (None without one): the
        time to wake the worker if it has nothing else to compute."""
        return self.loads.next_pull_s(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Schedule one step (blocks allocated and registered now, as the engine does);
        returns its duration, None when there is nothing to do."""
        budget = self.profile.max_num_batched_tokens
        self._step = []
        extra_s, self._carry_s = self._carry_s, 0.0
        extra_s += self._land_arrived(now)
        preempted = False
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0 or seq not in self.running:
                continue
            k = min(self._computable(seq), budget)
            if k == 0:
                continue
            ok, lost = self._allocate_or_preempt(seq, k, scheduled)
            preempted = preempted or lost
            if ok:
                scheduled.add(id(seq))
                self._schedule(seq, k)
                budget -= k
        if not preempted:
            extra_s += self._admit(budget, now)
        if not self._step:
            return None
        self.num_steps += 1
        others = 0 if self.host is None else self.host.others_stepping(self.worker_id, now)
        duration = self._jitter.apply(self._step_s(others)) + extra_s
        if self.host is not None:
            self.host.stepping(self.worker_id, now + duration)
        self.busy_s += duration
        return duration

    def finish_step(self, now: float) -> list[SimSeq]:
        """The step scheduled last ended at `now`: advance its requests; the finished ones."""
        finished = []
        gaps_s, num_gaps = 0.0, 0
        for seq, k in self._step:
            seq.computed += k
            seq.num_computed += k
            if seq.prefill_only:
                full = min(seq.computed, seq.req.prompt_len) // self.block_size
                seq.chunk_times.append((full, now))
            if seq.awaits_load() and self.loads.arrived(seq, now):
                self._carry_s += self.loads.land(seq, now)
            if seq.computed < seq.num_tokens:
                continue
            seq.generated += 1
            seen = now + self.profile.hop_s  # when the client sees the token
            seq.token_times.append(seen)
            # A gap between two of its tokens made here (a hand-off's first is the pull's).
            if seq.generated >= (3 if seq.pulls_prompt else 2):
                gaps_s += seen - seq.token_times[-2]
                num_gaps += 1
            if seq.first_token_s is None:
                seq.first_token_s = seen
            if seq.generated >= seq.num_to_generate:
                seq.finish_s = now
                self.running.remove(seq)
                self._free(seq)
                finished.append(seq)
        self._step = []
        if self.gaps is not None and num_gaps:
            self.gaps.observe(now, gaps_s, num_gaps)
        return finished

    def _step_s(self, others_stepping: int) -> float:
        chunks, decodes = [], []
        for seq, k in self._step:
            if k == 1 and seq.generated > 0:
                decodes.append(seq.computed)
            else:
                chunks.append((k, seq.computed))
        return self.profile.step_s(chunks, decodes, others_stepping)

    def _schedule(self, seq: SimSeq, k: int) -> None:
        """Compute `k` tokens of `seq` this step; the full prompt blocks they complete are
        registered now (before their KV exists, as in the engine)."""
        self._step.append((seq, k))
        hashes = seq.req.hashes
        end = min((seq.computed + k) // self.block_size, seq.req.num_full_blocks)
        for i in range(seq.computed // self.block_size, end):
            parent = hashes[i - 1] if i > 0 else None
            self.pool.register(seq.block_ids[i], hashes[i], (), parent)

    def _computable(self, seq: SimSeq) -> int:
        left = seq.num_tokens - seq.computed
        return left if seq.load is None else min(left, seq.load.split_token - seq.computed)

    def _land_arrived(self, now: float) -> float:
        """Land the pulls that arrived for running requests waiting on them (the engine's
        `land_ready` before scheduling); returns the seconds the copies take."""
        seconds = 0.0
        for seq in self.running:
            if seq.awaits_load() and self.loads.arrived(seq, now):
                seconds += self.loads.land(seq, now)
        return seconds

    def _admit(self, budget: int, now: float) -> float:
        """Admit waiting requests in order; returns the seconds their fetches take."""
        fetch_s = 0.0
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            seq = self.waiting[0]
            seconds = self._match(seq, now)
            k = min(self._computable(seq), budget)
            if k == 0 and seq.awaits_load():  # a pull under way: it runs once that landed
                self.running.append(self.waiting.popleft())
                continue
            if k == 0 or not self._allocate(seq, k):
                self._free(seq)  # give the hits back; retry next step
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._schedule(seq, k)
            budget -= k
            fetch_s += seconds
        return fetch_s

    # ---- blocks -----------------------------------------------------------------------------

    def _allocate(self, seq: SimSeq, k: int) -> bool:
        need = -(-(seq.computed + k) // self.block_size) - len(seq.block_ids)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def _allocate_or_preempt(self, seq: SimSeq, k: int, scheduled: set[int]) -> tuple[bool, bool]:
        """(allocated, preempted someone): the newest running request makes room."""
        preempted = False
        while not self._allocate(seq, k):
            victim = self.running[-1]
            if id(victim) in scheduled:
                return False, preempted
            self.running.remove(victim)
            self._free(victim)
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

    def _free(self, seq: SimSeq) -> None:
        """Give back every block of `seq`, tail first (a prefix's head is evicted last)."""
        self.loads.drop(seq)
        # A hand-off's decode holds a copy of a prompt its prefill worker keeps: evicted first.
        self.pool.free(list(reversed(seq.block_ids)), evict_first=seq.pulls_prompt)
        seq.block_ids = []
        seq.computed = 0

    def _demote(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        tokens: tuple[int, ...],
        parent: BlockHash | None,
    ) -> None:
        assert self.tiers is not None
        self.tiers.demote(stand_in_block(block_hash, parent))

    # ---- cache hits -------------------------------------------------------------------------

    def _match(self, seq: SimSeq, now: float) -> float:
        """Reuse the device's longest prefix of a request holding no blocks, then plan what the
        tiers and a holder add; returns the seconds the engine's thread spends fetching."""
        hits: list[BlockId] = []
        # A disaggregated request's decode knows its first token: every full block may hit.
        limit = seq.req.num_full_blocks if seq.pulls_prompt else seq.req.max_match_blocks
        for block_hash in seq.req.hashes[:limit]:
            block_id = self.pool.lookup(block_hash, ())
            if block_id is None:
                break
            hits.append(block_id)
        self.pool.touch(hits)
        seq.block_ids = hits
        seq.computed = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.cached = {TIER_HBM: seq.computed}
        if seq.pulls_prompt:  # the router's call for it comes a hop after the first token
            return self.loads.plan_handoff(seq, len(hits), now + self.profile.hop_s)
        return self.loads.plan(seq, len(hits), now)
