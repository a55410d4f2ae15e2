"""The fetches that land later: a split's back part and a peer's pull, read in the background.

`KVTiering` starts a `PendingLoad` when it plans one and lands it when it is due; `PendingLoads`
holds them by request and answers what the scheduler asks meanwhile: how far a request may
compute, whether it waits on its load, and when a pull has arrived. Only the engine's thread
calls it; the futures are the background threads' side.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from cachesvc.kv.tiers.results import FetchResult
from cachesvc.kv.types import BlockHash, RequestId
from workers.engine.request import Request
from workers.engine.tiering.peer import PeerRead, is_peer

Ranges = list[tuple[str, list[BlockHash]]]  # (tier or peer, its run of hashes), in chain order


@dataclass(frozen=True)
class PendingPull:
    """The peer's part of a pending load: its pull, how many blocks and how long predicted."""

    future: Future[PeerRead]
    num_blocks: int
    predicted_s: float


@dataclass
class PendingLoad:
    """A fetch running in the background while the request computes up to `split_token`."""

    split_token: int
    ranges: Ranges  # the local ones pinned until the fetch lands or is dropped
    future: Future[FetchResult]
    started: float  # perf_counter when the fetch was submitted
    overlap_s: float  # predicted max(front compute, back read), without the overlap delay
    pull: PendingPull | None = None  # a peer's run after the local ones

    def done(self) -> bool:
        return self.future.done() and (self.pull is None or self.pull.future.done())


def local_ranges(ranges: Ranges) -> Ranges:
    """The ranges read from this worker's own tiers (pinned while planned)."""
    return [(name, hashes) for name, hashes in ranges if not is_peer(name)]


class PendingLoads:
    """The requests' pending loads, at most one each."""

    def __init__(self) -> None:
        self._loads: dict[RequestId, PendingLoad] = {}
        # Blocks pulls in flight bring, by hash, with how many pulls bring each: asked about
        # every waiting request's blocks at each load report, so a lookup, not a scan.
        self._pulled: dict[BlockHash, int] = {}

    def add(self, request_id: RequestId, load: PendingLoad) -> None:
        self._loads[request_id] = load
        for h in _pulled_hashes(load):
            self._pulled[h] = self._pulled.get(h, 0) + 1

    def num_computable(self, request: Request, num_left: int) -> int:
        """Tokens the request may compute before its load is due (at most `num_left`)."""
        load = self._loads.get(request.request_id)
        if load is None:
            return num_left
        return min(num_left, load.split_token - request.num_computed_tokens)

    def num_planned_blocks(self, request_id: RequestId) -> int:
        """Blocks the request's load is to bring (0 without one)."""
        load = self._loads.get(request_id)
        return 0 if load is None else sum(len(hashes) for _, hashes in load.ranges)

    def pulling(self, block_hash: BlockHash) -> bool:
        """True when a pull in flight is to bring the block `block_hash`."""
        return block_hash in self._pulled

    def due(self, request: Request) -> PendingLoad | None:
        """The request's load once the request computed up to its split, and so has nothing
        to compute until it lands; None while it has none or is not there yet."""
        load = self._loads.get(request.request_id)
        if load is None or request.num_computed_tokens < load.split_token:
            return None
        return load

    def wait(self, timeout_s: float) -> None:
        """Block until a pull in flight arrives, at most `timeout_s`; return at once without
        one. Local reads are not waited on here: landing a due one waits for it."""
        futures = [p.pull.future for p in self._loads.values() if p.pull is not None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def take(self, request_id: RequestId) -> PendingLoad:
        """Remove the request's load to land it; its reads keep running to be waited on."""
        load = self._loads.pop(request_id)
        for h in _pulled_hashes(load):
            self._pulled[h] -= 1
            if not self._pulled[h]:
                del self._pulled[h]
        return load

    def drop(self, request_id: RequestId) -> Ranges:
        """Forget the request's load and cancel its reads (a pull already under way ends
        unused). Returns its local ranges for the caller to unpin; [] when it had none."""
        if request_id not in self._loads:
            return []
        load = self.take(request_id)
        load.future.cancel()
        if load.pull is not None:
            load.pull.future.cancel()
        return local_ranges(load.ranges)

    def drop_all(self) -> None:
        """Drop every load, at close: the tiers are closing, so nothing is unpinned."""
        for request_id in list(self._loads):
            self.drop(request_id)


def _pulled_hashes(load: PendingLoad) -> list[BlockHash]:
    """The blocks a load pulls from a peer (none for a load from the local tiers only)."""
    if load.pull is None:
        return []
    return [h for name, hashes in load.ranges if is_peer(name) for h in hashes]
