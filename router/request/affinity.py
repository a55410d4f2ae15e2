"""Affinity keys (OpenAI's `prompt_cache_key`): which worker each key's requests went to last,
so that the next one goes there too while that worker is within the routing policy's bounds.

A key belongs to its tenant: it is scoped by the request's cache salt, so two tenants using the
same key share nothing. The table is bounded (least recently used keys forgotten first); a
forgotten key, or one whose worker left, is routed as any request is and remembered anew.
"""

from __future__ import annotations

from collections import OrderedDict

from cachesvc.kv.types import WorkerId

MAX_KEYS = 65_536  # keys remembered, least recently routed forgotten first


def scoped_key(cache_salt: str | None, affinity_key: str | None) -> str | None:
    """The table's key of a request: its affinity key within its salt (None without a key)."""
    if affinity_key is None:
        return None
    return f"{cache_salt or ''}\x00{affinity_key}"


class AffinityTable:
    """Key -> the worker its last request was routed to; mutated by `routed` only."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        assert max_keys > 0
        self.max_keys = max_keys
        self._workers: OrderedDict[str, WorkerId] = OrderedDict()

    def worker(self, key: str | None) -> WorkerId | None:
        """The worker `key`'s last request went to; None for no key or one not remembered."""
        return None if key is None else self._workers.get(key)

    def routed(self, key: str | None, worker: WorkerId) -> None:
        """`key`'s request was routed to `worker` (nothing for no key)."""
        if key is None:
            return
        self._workers[key] = worker
        self._workers.move_to_end(key)
        while len(self._workers) > self.max_keys:
            self._workers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._workers)
