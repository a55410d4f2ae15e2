"""A peer as one more source of blocks for the load planner.

A request may carry a `PeerSource` (from the router's holder hint): another worker that holds a
longer prefix of its prompt. `KVTiering` then offers the planner, after the runs the local tiers
hold, one more run: the blocks the peer holds beyond them, under the tier name `peer:<name>`, at
that peer's calibrated cost (latency + seconds per byte, learned from every pull like any
tier's; its prior is `calibration.DEFAULT_TIER_COSTS["peer"]`). The planner picks fetch, split
or recompute as for any tier; a planned pull runs on a background thread (`PeerPuller.read`, in
chunks of blocks) while the engine keeps stepping. Each chunk arrives as one buffer
(`workers.transfer.chunk.KVChunk`) and is checked against the hashes this worker computed under
the request's own salt (the chunk's digest covers them); its rows land as blocks without another
copy. A peer that is gone, fails or does not answer by the pull's deadline — set when the pull
is planned, not when a thread picks it up — costs the recompute of what did not arrive.

The transport (`PeerLink`) is the actor's (`workers.transfer.ray_link`); the engine only sees
this interface.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from cachesvc.kv.calibration import CostTracker, default_tier_cost
from cachesvc.kv.codec import KVBlock
from cachesvc.kv.planner import CostModel, TierCost
from cachesvc.kv.tiers.results import Transfer
from cachesvc.kv.types import BlockHash
from workers.engine.request import PeerSource
from workers.transfer.chunk import KVChunk, verify_chunk
from workers.transfer.threads import transfer_executor

PEER_PREFIX = "peer:"
# Blocks per call of a pull: when a peer dies mid-run the chunks that arrived still land. The
# calls are made at once, so a long run waits for one of the peer's step boundaries, not one per
# chunk (a step can take seconds on a CPU).
PULL_CHUNK_BLOCKS = 32


def peer_tier(name: str) -> str:
    """The tier name a peer's blocks are planned and counted under."""
    return PEER_PREFIX + name


def is_peer(tier: str) -> bool:
    return tier.startswith(PEER_PREFIX)


class PeerLink(Protocol):
    """How a worker asks a peer for blocks (the actor's Ray transport)."""

    def fetch(
        self,
        peer: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        chunks: Sequence[tuple[int, int]],
        deadline: float,
        follow: bool = False,
        stop: threading.Event | None = None,
    ) -> Generator[KVChunk, None, None]:
        """The peer's chunk of each `(start_block, end_block)` of the prompt (its leading blocks
        it holds), in order, all asked for at once; raises, at the chunk that did not come, on
        any failure (gone, refused, not in by `deadline`, a `time.monotonic()`), and cancels
        what is outstanding when closed early. `follow`: the peer is computing the prompt, and
        each chunk waits there until its blocks are. `stop`: once set, the wait for a chunk
        ends (raises). Blocking: called from a background thread."""
        ...


@dataclass
class PeerStats:
    """Counters of pulls: planned, blocks landed, failures, and predicted vs measured time."""

    planned: int = 0
    pulled_blocks: int = 0
    missed_blocks: int = 0  # planned, arrived missing or not verifying: computed instead
    failures: int = 0  # the peer did not answer (gone, error, timeout)
    pulled_bytes: int = 0
    predicted_s: float = 0.0  # of the pulls that answered
    measured_s: float = 0.0
    # Blocks of the pulls planned and not yet arrived (or failed): work on its way to this
    # worker, in its load report beside the queued tokens a pull is not.
    in_flight_blocks: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f"peer_{k}": float(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class ChunkCheck:
    """How a puller checks a chunk: the digest's key and mode, and its own cache's layout."""

    key: bytes
    mode: str
    fingerprint: str
    block_shape: tuple[int, ...]


@dataclass
class PeerRead:
    """What one pull brought: the verified leading blocks and the measured transfer."""

    blocks: list[KVBlock] = field(default_factory=list)
    transfer: Transfer | None = None
    failed: bool = False


class PeerPuller:
    """Offers a request's peer run to the planner and pulls it; owned by `KVTiering`."""

    def __init__(
        self,
        link: PeerLink,
        check: ChunkCheck,
        costs: CostTracker,
        block_bytes: int,
        timeout_s: float,
    ) -> None:
        self.link = link
        self.check = check
        self.costs = costs
        self.block_bytes = block_bytes  # a raw block's encoded size, for the cost prior
        self.timeout_s = timeout_s
        self.chunk_blocks = PULL_CHUNK_BLOCKS
        self.stats = PeerStats()
        self._lock = threading.Lock()
        # Pulls wait on the network, not the cores: a few at once, apart from the tiers' reads,
        # below the engine's priority (their digest checks take cores from its steps).
        self._executor = transfer_executor(4, "kv-peer")

    def submit(
        self,
        source: PeerSource,
        token_ids: Sequence[int],
        cache_salt: str | None,
        hashes: Sequence[BlockHash],
        start_block: int,
    ) -> Future[PeerRead]:
        """Start a pull (`read`) on a pull thread; its deadline runs from now, the moment it
        is planned, however long it waits for a thread."""
        deadline = time.monotonic() + self.timeout_s
        num = len(hashes)
        with self._lock:
            self.stats.in_flight_blocks += num
        future = self._executor.submit(
            self.read, source, token_ids, cache_salt, hashes, start_block, deadline
        )
        future.add_done_callback(lambda _: self._arrived(num))
        return future

    def _arrived(self, num_blocks: int) -> None:
        with self._lock:  # a pull thread's callback, beside the engine's thread
            self.stats.in_flight_blocks -= num_blocks

    def cost(self, source: PeerSource) -> str:
        """The peer's tier name, its cost known to the planner (the prior until measured)."""
        tier = peer_tier(source.name)
        self.costs.tiers.setdefault(tier, self._prior())
        return tier

    def _prior(self) -> TierCost:
        return default_tier_cost("peer", self.block_bytes)

    def block_s(self, model: CostModel) -> float:
        """Seconds to pull one block of a long run and land it, for the router's estimate: the
        mean over the peers pulled from so far (their transfer alone), else the prior."""
        costs = [t for name, t in model.tiers.items() if is_peer(name)] or [self._prior()]
        transfer = sum(t.bytes_per_block * t.seconds_per_byte for t in costs) / len(costs)
        return transfer + model.land_s_per_block

    def read(
        self,
        source: PeerSource,
        token_ids: Sequence[int],
        cache_salt: str | None,
        hashes: Sequence[BlockHash],
        start_block: int,
        deadline: float,
    ) -> PeerRead:
        """Pull blocks `start_block .. start_block + len(hashes)` of the prompt from the peer,
        in calls of `chunk_blocks` made at once (the peer stages them at its next step
        boundaries), and check each chunk against `hashes` (this worker's, under the request's
        salt); the run stops at a chunk that is short or does not check out, or at a call that
        fails, with what arrived before kept. All calls end by `deadline`. Blocking;
        thread-safe."""
        began = time.perf_counter()
        chunks = [
            (start_block + lo, start_block + min(lo + self.chunk_blocks, len(hashes)))
            for lo in range(0, len(hashes), self.chunk_blocks)
        ]
        out = PeerRead()
        num_bytes = 0
        sent_chunks = self.link.fetch(source.name, token_ids, cache_salt, chunks, deadline)
        try:
            for (first, end), sent in zip(chunks, sent_chunks, strict=False):
                expected = hashes[first - start_block : end - start_block]
                verified = self.verify(sent, first, expected)
                out.blocks.extend(verified)
                num_bytes += sum(b.array.nbytes for b in verified)
                if len(verified) < len(expected):
                    break
        except Exception:  # any failure of the peer is a recompute, never the request's error
            out.failed = True
        finally:
            sent_chunks.close()  # what is still outstanding is cancelled at the peer
        seconds = time.perf_counter() - began
        out.transfer = Transfer(peer_tier(source.name), num_bytes, seconds, len(out.blocks))
        return out

    def verify(self, sent: KVChunk, start_block: int, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The blocks of `sent` when its digest checks out against `hashes` (each hash names
        its whole chain, so a chunk in its place is the right one), else none. The blocks are
        views of the chunk's rows: landing them is the only copy on this side."""
        c = self.check
        if sent.start_block != start_block or not verify_chunk(
            sent, c.key, c.mode, c.fingerprint, hashes, c.block_shape
        ):
            return []
        # A block's parent is informational here: landing takes it from the request's chain.
        return [
            KVBlock(h, hashes[i - 1] if i else None, sent.dtype, sent.payload[i], sent.lossy)
            for i, h in enumerate(hashes[: sent.num_blocks])
        ]

    def settle(self, read: PeerRead, planned: int, predicted_s: float) -> None:
        """Count a finished pull and learn the peer's cost from it (on the engine's thread);
        a pull cut short by a failure teaches nothing of the peer's speed."""
        self.stats.planned += 1
        self.stats.pulled_blocks += len(read.blocks)
        self.stats.missed_blocks += planned - len(read.blocks)
        t = read.transfer
        if t is not None:
            self.stats.pulled_bytes += t.num_bytes
        if read.failed:
            self.stats.failures += 1
        elif t is not None:
            self.stats.predicted_s += predicted_s
            self.stats.measured_s += t.seconds
            self.costs.observe_transfer(t)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
