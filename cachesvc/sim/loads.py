"""What a simulated worker's lower tiers and a holder add to a request's device prefix.

As the engine's `KVTiering` does: the runs the local tiers hold after the device prefix, then
(with pulls on, and a holder hint on the request) the holder's blocks beyond them as one more
run (`PEER`), go to the real planner, priced by the worker's cost model. A fetch from the tiers
is read on the engine's thread (the step takes that much longer); a split reads the back while
the front is computed and lands when the front is done (the engine waits for a read still
running). A plan with a pull runs all its reads in the background: the request computes up to
the split (nothing, for a plain fetch) and then waits for the pull, but the engine does not, so
the worker's other requests keep stepping; the pull's time never occupies the worker's compute.
Landed blocks are registered in the pool, so the index learns that the puller holds them.

A disaggregated request's decode (`plan_handoff`) pulls the prompt's full blocks from its
prefill worker whatever the planner would say: the decode side of a pair does not compute
prompts. With an early pull (the router's `pd_prefetch`) the blocks started moving when the
prompt was routed, each step's once that step ended: the hand-off waits only for the rest.

The holder pays for what it sends: its engine stages the run between two steps (a gather into
a host buffer), so its next step takes `stage_s_per_byte` per byte sent longer (the profile's,
measured by `cachesvc bench kv-transfer`); an idle holder pays nothing anyone waits for. It
sends what it holds when the pull is planned, including blocks registered by a step still
computing them (the live holder exports between steps, so at most a step later).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.planner import CostModel, LoadPlan, plan_load
from cachesvc.kv.tiers.results import FetchResult, TierHit
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash
from cachesvc.sim.seq import EarlyPull, PendingLoad, Ranges, SimSeq
from router.policy.routing import PEER


class SimLoads:
    """Plans and lands a worker's loads; owned by a `SimWorker`, mutates its pool, tiers and
    the requests it is handed."""

    def __init__(
        self,
        pool: BlockPool,
        tiers: TierManager | None,
        cost: CostModel,
        block_size: int,
        peer_pull: bool = False,
        stage_s_per_byte: float = 0.0,
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        self.cost = cost
        self.block_size = block_size
        self.peer_pull = peer_pull
        self.stage_s_per_byte = stage_s_per_byte  # what the holder pays per byte it sends
        self.plans: Counter[str] = Counter()
        self.pulled_blocks = 0  # landed from holders, preempted requests' included
        self.pulled_bytes = 0

    def plan(self, seq: SimSeq, first: int, now: float) -> float:
        """Plan the blocks after the device prefix (`first` blocks) of `seq`, which holds only
        that prefix: a fetch lands at once, a split or a pull is left pending on `seq`. Returns
        the seconds the engine's thread spends (0.0 for anything in the background)."""
        hashes = seq.req.hashes
        # Keep a free block for the token that must be computed.
        end = min(seq.req.max_match_blocks, first + self.pool.num_free - 1)
        if end <= first:
            return 0.0
        hits = self._local_hits(seq, first, end)
        peer = self._peer_hit(seq, hits[-1].end if hits else first, end)
        if peer is not None:
            hits.append(peer)
        if not hits:
            return 0.0
        plan = plan_load(hits, first, seq.num_tokens, self.block_size, self.cost)
        self.plans[plan.kind] += 1
        if plan.kind in ("none", "recompute"):
            return 0.0
        ranges: Ranges = [(f.tier, list(hashes[f.start : f.end])) for f in plan.fetch]
        local = _local(ranges)
        if self.tiers is not None:
            self.tiers.pin(local)
        seq.block_ids.extend(self.pool.allocate(plan.fetch_end - first))
        split_token = plan.split_block * self.block_size
        if len(local) < len(ranges):
            seq.load = self._pull(seq, plan, ranges, now)
            return 0.0
        if plan.kind == "split":
            ready = now + self._read_s([(name, len(h)) for name, h in ranges])
            seq.load = PendingLoad(split_token, ranges, ready)
            return 0.0
        assert self.tiers is not None
        result = self.tiers.read(ranges)
        self.tiers.unpin(ranges)
        self.tiers.settle(result)
        landed = self._land(seq, len(result.blocks), first, ranges)
        keep = -(-seq.computed // self.block_size)
        self.pool.free(list(reversed(seq.block_ids[keep:])))
        del seq.block_ids[keep:]
        return self._read_s(_read_runs(result)) + self.cost.land_s(landed)

    def plan_handoff(self, seq: SimSeq, first: int, now: float) -> float:
        """A disaggregated request's decode (`seq.pulls_prompt`), holding its device prefix
        (`first` blocks): it pulls the prompt's other full blocks from its prefill worker
        (`seq.peer`), never the planner's choice to recompute them, as the decode side of a
        pair must; what the holder no longer has (or no room here) it computes. Returns 0.0:
        the pull runs in the background."""
        assert seq.peer is not None
        end = min(seq.req.num_full_blocks, first + self.pool.num_free - 1)
        if end <= first:
            return 0.0
        self.plans["handoff"] += 1
        ranges: Ranges = [(PEER, list(seq.req.hashes[first:end]))]
        seq.block_ids.extend(self.pool.allocate(end - first))
        sent, pull_s = self._ask_holder(seq, ranges[0][1])
        ready = now + pull_s
        if seq.early is not None:
            ready = max(now, self._early_ready(seq.early, first, first + sent))
        seq.load = PendingLoad(first * self.block_size, ranges, ready, sent)
        return 0.0

    def _early_ready(self, early: EarlyPull, first: int, end: int) -> float:
        """When a pull made while the prefill ran has blocks `first .. end - 1`: each chunk's
        sent once computed, after the ones before it (one link, in order)."""
        peer = self.cost.tiers[PEER]
        block_s = peer.bytes_per_block * peer.seconds_per_byte
        t, moved = early.start_s, first
        for computed, when in early.chunks:
            new = min(computed, end) - moved
            if new > 0:
                t = max(t, when) + new * block_s
                moved += new
        return t + peer.latency_s

    def arrived(self, seq: SimSeq, now: float) -> bool:
        """Whether `seq`'s load may land now that the front is computed: a split's always
        (the engine waits for its read), a pull's once it is done."""
        assert seq.load is not None
        return not seq.load.is_pull or seq.load.ready_s <= now

    def land(self, seq: SimSeq, now: float) -> float:
        """Land `seq`'s pending load (its front is computed); returns how long the engine
        waits (for a read still running, then for the copy)."""
        load, seq.load = seq.load, None
        assert load is not None
        local = _local(load.ranges)
        n, whole = 0, True
        if local:
            assert self.tiers is not None
            result = self.tiers.read(local)
            self.tiers.unpin(local)
            self.tiers.settle(result)
            n = len(result.blocks)
            whole = n == sum(len(h) for _, h in local)
        if load.peer_blocks is not None:
            self.pulled_blocks += load.peer_blocks
            self.pulled_bytes += round(load.peer_blocks * self.cost.tiers[PEER].bytes_per_block)
            if whole:  # the pull extends the local run only when all of that landed
                n += load.peer_blocks
        landed = self._land(seq, n, load.split_token // self.block_size, load.ranges)
        return max(0.0, load.ready_s - now) + self.cost.land_s(landed)

    def drop(self, seq: SimSeq) -> None:
        """Forget `seq`'s pending load (it is preempted or done): unpin its local reads; a
        pull under way ends unused."""
        if seq.load is not None and self.tiers is not None:
            self.tiers.unpin(_local(seq.load.ranges))
        seq.load = None

    def next_pull_s(self, seqs: Sequence[SimSeq]) -> float | None:
        """When the first pull that one of `seqs` waits for arrives, None without one."""
        times = [
            s.load.ready_s
            for s in seqs
            if s.load is not None and s.load.is_pull and s.awaits_load()
        ]
        return min(times, default=None)

    # ---- internals --------------------------------------------------------------------------

    def _local_hits(self, seq: SimSeq, first: int, end: int) -> list[TierHit]:
        if self.tiers is None:
            return []
        runs = self.tiers.lookup(seq.req.hashes[first:end])
        return [TierHit(h.tier, h.start + first, h.end + first) for h in runs]

    def _peer_hit(self, seq: SimSeq, start: int, end: int) -> TierHit | None:
        """The holder's run after block `start` (below `end`), as the router's hint gave it."""
        if not self.peer_pull or seq.peer is None or min(seq.peer.num_blocks, end) <= start:
            return None
        return TierHit(PEER, start, min(seq.peer.num_blocks, end))

    def _pull(self, seq: SimSeq, plan: LoadPlan, ranges: Ranges, now: float) -> PendingLoad:
        """A plan with a pull: the local reads and the pull run side by side in the
        background; the holder sends the leading part of the run it still holds."""
        local_s = self._read_s([(name, len(h)) for name, h in _local(ranges)])
        sent, pull_s = self._ask_holder(seq, dict(ranges)[PEER])
        ready = now + max(local_s, pull_s)
        return PendingLoad(plan.split_block * self.block_size, ranges, ready, sent)

    def _ask_holder(self, seq: SimSeq, hashes: Sequence[BlockHash]) -> tuple[int, float]:
        """(blocks sent, seconds the pull takes): the holder sends the leading part of `hashes`
        it still holds, and pays for staging them."""
        assert seq.peer is not None
        sent = seq.peer.holder.num_held(hashes)
        peer = self.cost.tiers[PEER]
        seq.peer.holder.charge(sent * peer.bytes_per_block * self.stage_s_per_byte)
        return sent, peer.fetch_s(sent) if sent else peer.latency_s  # empty: a round trip

    def _land(self, seq: SimSeq, n: int, first: int, ranges: Ranges) -> int:
        """Register `n` fetched blocks from block `first` on and move the request past them;
        their tokens count as cached by the tier they came from."""
        hashes = seq.req.hashes
        for idx in range(first, first + n):
            parent = hashes[idx - 1] if idx > 0 else None
            self.pool.register(seq.block_ids[idx], hashes[idx], (), parent)
        seq.computed = (first + n) * self.block_size
        if seq.num_preemptions == 0:
            left = n
            for name, run in ranges:
                taken = min(len(run), left)
                left -= taken
                seq.cached[name] = seq.cached.get(name, 0) + taken * self.block_size
        return n

    def _read_s(self, runs: Sequence[tuple[str, int]]) -> float:
        return sum(self.cost.tiers[name].fetch_s(n) for name, n in runs)


def _local(ranges: Ranges) -> Ranges:
    return [(name, hashes) for name, hashes in ranges if name != PEER]


def _read_runs(result: FetchResult) -> list[tuple[str, int]]:
    return [(t.tier, t.num_blocks) for t in result.transfers]
