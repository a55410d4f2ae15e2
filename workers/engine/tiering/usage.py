"""Where each request's prompt came from: tokens per tier ("hbm" for the device, "peer" for any
peer worker), reported with the request's usage after it ends."""

from __future__ import annotations

from collections import OrderedDict

from cachesvc.kv.events import TIER_HBM
from cachesvc.kv.types import RequestId
from workers.engine.tiering.peer import is_peer
from workers.engine.tiering.pending_loads import Ranges
from workers.protocol import PEER_TOKENS

_MAX_USAGE = 10_000  # per-request usage reports kept after the request ends


def _landed_by_tier(ranges: Ranges, num_landed: int, block_size: int) -> dict[str, int]:
    """Tokens per tier among the first `num_landed` blocks of `ranges` (peers as "peer")."""
    out: dict[str, int] = {}
    for name, hashes in ranges:
        n = min(len(hashes), num_landed)
        num_landed -= n
        if n:
            key = _usage_name(name)
            out[key] = out.get(key, 0) + n * block_size
    return out


def _usage_name(tier: str) -> str:
    return PEER_TOKENS if is_peer(tier) else tier


class TierUsage:
    """Tokens per tier of the most recent requests' prompts, kept after they end."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._usage: OrderedDict[RequestId, dict[str, int]] = OrderedDict()

    def get(self, request_id: RequestId) -> dict[str, int]:
        """A copy of the request's tokens per tier; {} for one unknown or long forgotten."""
        return dict(self._usage.get(request_id, {}))

    def start(self, request_id: RequestId, num_device_blocks: int) -> None:
        """The request's device match: restart its report from it, forgetting the oldest
        reports beyond `_MAX_USAGE`."""
        self._usage[request_id] = {TIER_HBM: num_device_blocks * self.block_size}
        self._usage.move_to_end(request_id)
        while len(self._usage) > _MAX_USAGE:
            self._usage.popitem(last=False)

    def planned(self, request_id: RequestId, ranges: Ranges, num_blocks: int) -> None:
        """Count the first `num_blocks` of a background load as served by their tiers, before
        it lands (`landed` corrects what fails)."""
        self._usage[request_id].update(_landed_by_tier(ranges, num_blocks, self.block_size))

    def landed(self, request_id: RequestId, ranges: Ranges, num_landed: int) -> None:
        """The first `num_landed` blocks of a load's `ranges` landed; the rest are computed."""
        # The report may be forgotten by now (`_MAX_USAGE` newer ones): nothing to correct.
        self._usage.get(request_id, {}).update(
            {_usage_name(name): 0 for name, _ in ranges}
            | _landed_by_tier(ranges, num_landed, self.block_size)
        )
