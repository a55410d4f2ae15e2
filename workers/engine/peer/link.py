"""Pulling blocks from a peer worker over Ray: the `PeerLink` a worker's engine is given.

A peer is named by its Ray actor name (the router's holder hint) and looked up in the worker's
own namespace; handles are kept, and dropped when a call through one fails (the peer may have
been replaced under the same name). Called from the engine's pull threads, never from the
actor's event loop, so the blocking wait stalls nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from workers.protocol import PeerBlocks


class RayPeerLink:
    """Asks a peer's `WorkerActor.export_blocks` for a run of a prompt's blocks."""

    def __init__(self, namespace: str | None) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def fetch(
        self,
        peer: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        chunks: Sequence[tuple[int, int]],
        timeout_s: float,
    ) -> Iterator[PeerBlocks]:
        import ray

        deadline = time.monotonic() + timeout_s
        handle = self._handles.get(peer)
        if handle is None:
            handle = ray.get_actor(peer, namespace=self.namespace)  # ValueError: no such actor
            self._handles[peer] = handle
        ids = list(token_ids)
        try:
            # All at once: the peer answers them one after the other at its next step boundary.
            refs = [handle.export_blocks.remote(ids, cache_salt, lo, hi) for lo, hi in chunks]
            for ref in refs:
                # A future, not `ray.get`: this thread is not the actor's event loop, and the
                # wait is the same (Ray warns about any `ray.get` inside an async actor).
                sent = ref.future().result(timeout=max(deadline - time.monotonic(), 0.0))
                if not isinstance(sent, PeerBlocks):
                    raise TypeError(f"peer {peer} answered {type(sent).__name__}, not PeerBlocks")
                yield sent
        except Exception:
            self._handles.pop(peer, None)
            raise
