"""A handed-off request's KV pulled while its prefill runs.

When the router sends a prompt to a prefill worker for a hand-off, it tells the decode worker at
once (`WorkerActor.prefetch`): the decode worker asks the prefill worker for the prompt's blocks,
each chunk answered as soon as the prefill worker has computed it, and lands them in its pool.
When the first token is out and the request moves, its prompt is (mostly) there: the hand-off
pulls only the rest. A prefetch is cancelled when its request is served colocated after all; a
failed or late one only leaves more for the hand-off's own pull.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from router.pool.worker_state import WorkerState
from workers.protocol import HolderHint

_log = logging.getLogger(__name__)

# How long a prefetch may wait for its prefill: the prediction's multiple, and at least this.
_TIMEOUT_FACTOR = 3.0
_MIN_TIMEOUT_S = 30.0


class Prefetch:
    """One request's prefetch on its decode worker; `cancel` it when the hand-off is off."""

    def __init__(self, ref: Any, request_id: str) -> None:
        self._ref = ref
        self._request_id = request_id
        # Nobody awaits it: its result is read here, or Ray would log a cancelled or failed
        # prefetch as an error nobody handled.
        ref.future().add_done_callback(self._done)

    def cancel(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # finished, or its worker is gone
            ray.cancel(self._ref)

    def _done(self, future: Any) -> None:
        try:
            result = future.result()
        except Exception as exc:  # cancelled, or the decode worker failed: the pull does it
            _log.debug("prefetch of %s ended: %s", self._request_id, exc)
            return
        _log.debug("prefetch of %s: %s", self._request_id, result)


def start_prefetch(
    decode: WorkerState,
    prefill: WorkerState,
    prompt_ids: list[int],
    cache_salt: str | None,
    block_size: int,
    predicted_ttft_s: float,
    request_id: str,
) -> Prefetch | None:
    """Ask `decode` to pull the prompt's full blocks from `prefill` as they are computed (None:
    nothing to pull, or the prefill worker has no actor name to be found by)."""
    actor = prefill.info.actor_name if prefill.info is not None else None
    num_blocks = len(prompt_ids) // block_size
    if actor is None or num_blocks == 0 or decode.worker_id == prefill.worker_id:
        return None
    timeout_s = max(_MIN_TIMEOUT_S, _TIMEOUT_FACTOR * predicted_ttft_s)
    try:
        ref = decode.actor.prefetch.remote(
            HolderHint(actor, num_blocks), prompt_ids, cache_salt, timeout_s
        )
    except AttributeError:  # a worker of an older build: the hand-off's pull does it all
        return None
    return Prefetch(ref, request_id)
