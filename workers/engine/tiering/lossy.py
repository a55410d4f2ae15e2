"""Lossy KV on the device (`LossyKV`): which device blocks hold it, and which requests used it.

A block read back from a quantized tier is not the KV the model computes, and neither is any KV
computed over it: every later position attends to it. So a landed block is marked lossy in the
pool (`landing.land_blocks`), and after each compute every block behind a request's first lossy
block is marked too (`computed`): the blocks it computed over the lossy ones, those another
request computed that it matched (they sit behind the same lossy prefix there too), and a block
landed exactly behind a lossy one (cautious: it is kept out of the lossless tiers like the
rest). The pool clears a mark when it hands the block out for new KV, so a block recomputed
from exact KV is exact again.

A request whose blocks carried a mark when it computed, or when it ended with tokens sampled
over them (a forked sample that computed nothing of its own), used lossy KV (`used`): its
answer says so (`Usage.lossy_kv`), and still does if it is preempted and computed again, since
the tokens it had sampled came from that KV.

Only the engine's thread calls it.
"""

from __future__ import annotations

from collections import OrderedDict

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.types import RequestId
from workers.engine.request import Request

_MAX_REMEMBERED = 10_000  # requests that used lossy KV, kept after they end for their usage


class LossyKV:
    """The lossy marks of the device pool's blocks, and the requests that used lossy KV."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._used: OrderedDict[RequestId, None] = OrderedDict()

    def computed(self, request: Request) -> None:
        """The request computed tokens: if it holds a lossy block, what follows it is lossy
        too, and the request used lossy KV."""
        ids = request.block_ids
        if not self.pool.any_lossy(ids):
            return
        first = next(i for i, b in enumerate(ids) if self.pool.is_lossy(b))
        self.pool.mark_lossy(ids[first + 1 :])
        self._remember(request.request_id)

    def released(self, request: Request) -> None:
        """The request gives its blocks back; one that sampled tokens over lossy KV used it."""
        if request.output_token_ids:
            self.computed(request)

    def used(self, request_id: RequestId) -> bool:
        """Whether the request's tokens came from lossy KV (False for one long forgotten)."""
        return request_id in self._used

    def _remember(self, request_id: RequestId) -> None:
        self._used[request_id] = None
        self._used.move_to_end(request_id)
        while len(self._used) > _MAX_REMEMBERED:
            self._used.popitem(last=False)
