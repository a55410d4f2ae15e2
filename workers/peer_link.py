"""Pulling blocks from a peer worker over Ray: the `PeerLink` a worker's engine is given.

A peer is named by its Ray actor name (the router's holder hint) and looked up in the worker's
own namespace; handles are kept, and dropped when a call through one fails (the peer may have
been replaced under the same name). Called from the engine's pull threads, never from the
actor's event loop, so the blocking `ray.get` stalls nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engine.peer_pull import PeerBlocks


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
        start_block: int,
        end_block: int,
        timeout_s: float,
    ) -> PeerBlocks:
        import ray

        handle = self._handles.get(peer)
        if handle is None:
            handle = ray.get_actor(peer, namespace=self.namespace)  # ValueError: no such actor
            self._handles[peer] = handle
        try:
            ref = handle.export_blocks.remote(list(token_ids), cache_salt, start_block, end_block)
            sent = ray.get(ref, timeout=timeout_s)
        except Exception:
            self._handles.pop(peer, None)
            raise
        if not isinstance(sent, PeerBlocks):
            raise TypeError(f"peer {peer} answered {type(sent).__name__}, not PeerBlocks")
        return sent
