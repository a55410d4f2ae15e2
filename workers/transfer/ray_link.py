"""Moving chunks of KV between worker actors over Ray: the `PeerLink` a worker's engine is given.

A peer is named by its Ray actor name (the router's holder hint) and looked up in the worker's
own namespace; handles are kept, and dropped when a call through one fails (the peer may have
been replaced under the same name). Every chunk of a pull is asked for at once
(`WorkerActor.export_chunk`): the holder stages them at its next step boundaries, within its
per-boundary cap, and each comes back as a numpy buffer through Ray's object store — out of band,
read in place by this process, never pickled. On the pull's deadline, or the first failure, what
is still outstanding is cancelled, so the holder stops working for a pull nobody waits for.

Called from the engine's pull threads, never from the actor's event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Generator, Sequence
from typing import Any

from workers.transfer.chunk import KVChunk


class RayPeerLink:
    """Asks a peer actor for chunks of a prompt's blocks."""

    def __init__(self, namespace: str | None) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def fetch(
        self,
        peer: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        chunks: Sequence[tuple[int, int]],
        deadline: float,
    ) -> Generator[KVChunk, None, None]:
        """The peer's chunk of each `(start_block, end_block)`, in order; raises at the first
        that fails or is not in by `deadline` (`time.monotonic()`), after cancelling the rest.
        Blocking."""
        import ray

        handle = self._handle(peer)
        ids = list(token_ids)
        refs = [handle.export_chunk.remote(ids, cache_salt, lo, hi) for lo, hi in chunks]
        done = 0
        try:
            for ref in refs:
                # A future, not `ray.get`: this thread is not the actor's event loop (Ray warns
                # about any `ray.get` inside an async actor), and the wait is the same.
                sent = ref.future().result(timeout=_left(deadline))
                done += 1
                if not isinstance(sent, KVChunk):
                    raise TypeError(f"peer {peer} answered {type(sent).__name__}, not KVChunk")
                if sent.payload_ref is not None:
                    payload = sent.payload_ref.future().result(timeout=_left(deadline))
                    sent = dataclasses.replace(sent, payload=payload, payload_ref=None)
                yield sent
        except BaseException:
            self._handles.pop(peer, None)
            raise
        finally:
            _cancel(ray, refs[done:])

    def _handle(self, peer: str) -> Any:
        import ray

        handle = self._handles.get(peer)
        if handle is None:
            handle = ray.get_actor(peer, namespace=self.namespace)  # ValueError: no such actor
            self._handles[peer] = handle
        return handle


def put_payload(chunk: KVChunk) -> KVChunk:
    """The chunk with its payload copied into Ray's object store (out of band: a numpy array is
    one copy there, and read in place by the puller), so the staging buffer it was read from can
    serve the next chunk. Blocking: the holder calls it off its event loop."""
    import ray

    ref = ray.put(chunk.payload)
    return dataclasses.replace(chunk, payload=chunk.payload[:0].copy(), payload_ref=ref)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _cancel(ray: Any, refs: Sequence[Any]) -> None:
    """Cancel calls nobody waits for any more (a finished call ignores it)."""
    for ref in refs:
        with contextlib.suppress(Exception):  # the peer may be gone: nothing left to stop
            ray.cancel(ref)
