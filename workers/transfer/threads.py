"""Threads that move KV between workers run below the engine's priority.

A holder's seal and a puller's pull threads share the host's cores with the engines' steps;
on a small host every millisecond they take from a step is a millisecond of some stream's
inter-token gap. Their threads are niced (Linux sets a nice value per thread: `setpriority` on
the thread's id), so the scheduler gives a step the core first and the transfer what is left;
a transfer then takes longer, within its deadline, rather than a decode.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

TRANSFER_NICE = 10  # CFS weight 110 against a step's 1024: ~10% of a contended core


def lower_priority(nice: int = TRANSFER_NICE) -> None:
    """Lower the calling thread's CPU priority to `nice` (no-op where threads cannot be niced
    one by one, or where it is already lower)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def transfer_executor(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of `max_workers` threads at the transfer's priority (`lower_priority`)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=lower_priority)
