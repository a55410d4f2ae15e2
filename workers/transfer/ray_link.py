"""Moving chunks of KV between worker actors over Ray: the `PeerLink` a worker's engine is given.

A peer is named by its Ray actor name (the router's holder hint) and looked up in the worker's
own namespace; handles are kept, and dropped when a call through one fails (the peer may have
been replaced under the same name). Every chunk of a pull is asked for at once
(`WorkerActor.export_chunk`), the prompt's token ids put into the object store once for all of
them. Each call says who asks (`slots.PullerProcess`: this process and its Ray node): a holder
on the same node gathers the chunk into a shared-memory slot and answers with where it lies,
which this process maps read-only and reads in place (`slot_reader`); a holder on another node
answers with a numpy buffer through Ray's object store, out of band, read in place too. Either
way nothing is pickled. A slot's lease ends by a message: the link's thread sends the leases
this process is done with to their holders (`WorkerActor.release_slots`), batched per holder.
On the pull's deadline, or the first failure, what is still outstanding is cancelled, so the
holder stops working for a pull nobody waits for, and a slot leased in an answer nobody read is
released as soon as that answer arrives.

Called from the engine's pull threads, never from the actor's event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np

from workers.transfer.chunk import KVChunk
from workers.transfer.slot_reader import SlotReader
from workers.transfer.slots import PullerProcess, SlotLease, this_process

_log = logging.getLogger(__name__)
_STOP_POLL_S = 0.2  # how often a pull that may be stopped looks whether it is


class RayPeerLink:
    """Asks a peer actor for chunks of a prompt's blocks. `local`: offer same-node holders to
    read their slots in place (off: every chunk through the object store)."""

    def __init__(self, namespace: str | None, local: bool = True) -> None:
        import ray

        self.namespace = namespace
        self._handles: dict[str, Any] = {}
        # Releases are queued from finalizers (any thread, mid-collection) and sent from here.
        self._releases: queue.SimpleQueue[tuple[str, SlotLease]] = queue.SimpleQueue()
        self.slots = SlotReader(self._queue_release)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.puller: PullerProcess | None = this_process(node) if local else None
        if self.puller is not None:
            sender = threading.Thread(target=self._send_releases, name="kv-slot-release")
            sender.daemon = True
            sender.start()

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
        """The peer's chunk of each `(start_block, end_block)`, in order; raises at the first
        that fails or is not in by `deadline` (`time.monotonic()`), or once `stop` is set,
        after cancelling the rest. A chunk's payload may be a view of the peer's slot: its
        lease lasts as long as a view of it does. `follow`: each chunk waits at the peer until
        it has computed its blocks. Blocking."""
        import ray

        handle = self._handle(peer)
        # Once per pull, not pickled into every call (a 32K-token prompt is ~3 ms a call).
        ids = ray.put(np.asarray(token_ids, dtype=np.uint32))
        more = (True,) if follow else ()  # a peer of an older build is asked as before
        asked = [
            handle.export_chunk.remote(ids, cache_salt, lo, hi, self.puller, *more)
            for lo, hi in chunks
        ]
        done = 0
        try:
            for ref in asked:
                # A future, not `ray.get`: this thread is not the actor's event loop (Ray warns
                # about any `ray.get` inside an async actor), and the wait is the same.
                sent = _result(ref.future(), deadline, stop)
                done += 1
                if not isinstance(sent, KVChunk):
                    raise TypeError(f"peer {peer} answered {type(sent).__name__}, not KVChunk")
                yield self._with_payload(peer, sent, deadline)
        except BaseException:
            self._handles.pop(peer, None)
            raise
        finally:
            self._abandon(ray, peer, asked[done:])

    def _with_payload(self, peer: str, sent: KVChunk, deadline: float) -> KVChunk:
        """The chunk with its payload in hand: read in place from the object store or from
        the peer's slot."""
        if sent.payload_ref is not None:
            payload = sent.payload_ref.future().result(timeout=_left(deadline))
            return dataclasses.replace(sent, payload=payload, payload_ref=None)
        if sent.slot is not None:
            try:
                payload = self.slots.open(sent.slot, peer)
            except BaseException as exc:
                self.slots.release(sent.slot, peer)  # not read: the peer may reuse it
                if isinstance(exc, OSError):
                    # This process cannot open the peer's segments (another PID namespace, no
                    # /proc): this chunk is lost, the next pulls go through the object store.
                    _log.warning("cannot map a peer's slot (%s); pulls use the object store", exc)
                    self.puller = None
                raise
            return dataclasses.replace(sent, payload=payload, slot=None)
        return sent

    def _abandon(self, ray: Any, peer: str, refs: Sequence[Any]) -> None:
        """Cancel calls nobody waits for any more (a finished call ignores it); a slot leased in
        an answer that comes anyway is released when it does."""
        for ref in refs:
            with contextlib.suppress(Exception):  # the peer may be gone: nothing left to stop
                ray.cancel(ref)
            ref.future().add_done_callback(partial(self._release_unread, peer))

    def _release_unread(self, peer: str, answer: Future[Any]) -> None:
        with contextlib.suppress(Exception):  # cancelled, failed: nothing was leased
            sent = answer.result()
            if isinstance(sent, KVChunk) and sent.slot is not None:
                self.slots.release(sent.slot, peer)

    def _queue_release(self, holder: str, lease: SlotLease) -> None:
        self._releases.put((holder, lease))  # never blocks, safe inside a finalizer

    def _send_releases(self) -> None:
        """On the link's own thread, for the process's life: send the leases this process is
        done with to their holders, all those queued meanwhile in one call per holder. A
        holder that is gone took its slots with it: nothing to send it."""
        while True:
            waiting = [self._releases.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    waiting.append(self._releases.get_nowait())
            by_holder: defaultdict[str, list[SlotLease]] = defaultdict(list)
            for holder, lease in waiting:
                by_holder[holder].append(lease)
            for holder, leases in by_holder.items():
                try:
                    sent = self._handle(holder).release_slots.remote(leases)
                except Exception:  # no such actor any more, or Ray is shutting down
                    self._handles.pop(holder, None)
                    continue
                sent.future().add_done_callback(_ignore)  # its answer is nobody's business

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


def _ignore(answer: Future[Any]) -> None:
    with contextlib.suppress(Exception):  # read, so that Ray does not log it as unhandled
        answer.result()


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _result(answer: Future[Any], deadline: float, stop: threading.Event | None) -> Any:
    """The answer by `deadline`; with `stop`, looked at every `_STOP_POLL_S` and given up
    (TimeoutError) once it is set: a pull nobody waits for stops holding its thread."""
    if stop is None:
        return answer.result(timeout=_left(deadline))
    while True:
        try:
            return answer.result(timeout=min(_left(deadline), _STOP_POLL_S))
        except TimeoutError:
            if stop.is_set() or _left(deadline) <= 0:
                raise
