"""An engine timed step by step, the measurements both halves of `cachesvc simulate calibrate`
take: prefill steps of k new tokens after a cached prefix, decode-only steps of B sequences.
The engine runs in this process on the CPU (one torch thread unless told); the workers' model
by default. Callers time it at the live workers' priority (`at_worker_priority`): a machine
that other work shares slows it as it slows them.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cachesvc.kv.calibration import ComputeSample

BLOCK_SIZE = 16
DECODE_STEPS = 8
PREFILL_REPEATS = 3
_VOCAB_LOW = 100  # token ids from here up: clear of special tokens
# Ray starts its worker processes at this niceness (its `worker_niceness` default): a live worker
# yields the CPU to the router, the client and anything at the default priority, and shares it
# with background work at a low one (nice 19: 36 to 15 by the kernel's weights). Timed at the
# default priority, the engine sees neither, and a busy machine looks faster than to them.
WORKER_NICENESS = 15
T = TypeVar("T")


def at_worker_priority(fn: Callable[[], T]) -> T:
    """`fn()` on a thread of its own at the live workers' niceness (Linux sets it per thread;
    where it cannot, or this process is nicer already, at this process's); blocks until it
    returns, and raises what it raised."""
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            if os.getpriority(os.PRIO_PROCESS, tid) < WORKER_NICENESS:
                os.setpriority(os.PRIO_PROCESS, tid, WORKER_NICENESS)
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="engine-timing")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def tokens(n: int, seed: int | str, vocab: int) -> list[int]:
    """`n` token ids drawn from `seed`, clear of the special ones. The ids of a shorter draw
    from the same seed are a prefix of a longer one's: a cache would hit them."""
    rng = random.Random(seed)
    return [rng.randrange(_VOCAB_LOW, vocab) for _ in range(n)]


def timing_engine(model: str | None, folder: str | None, threads: int | None) -> Any:
    """An engine for timing; with a `folder`, a DRAM and an NVMe tier in it."""
    from cachesvc.kv.config import TierConfig
    from workers.config import EngineConfig
    from workers.engine.engine import Engine

    tiers = TierConfig() if folder is None else TierConfig(dram_mb=64, nvme_path=folder, nvme_mb=64)
    config = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        kv_cache_mb=256,  # the engine's other defaults (step budget, sequences) go in the profile
        num_threads=threads,
        tiers=tiers,
    )
    return Engine(config)


def greedy(max_tokens: int) -> Any:
    """Sampling that decodes exactly `max_tokens` tokens."""
    from workers.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed_step(engine: Any) -> float:
    """Seconds of one `engine.step()`."""
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure_prefill(
    engine: Any, shapes: Sequence[tuple[int, int]], seed: int = 0
) -> list[ComputeSample]:
    """One sample per (k, ctx): the median of three timed steps prefilling k tokens after a
    cached prefix of ctx tokens (the median, not the best: live steps see the machine as it
    is, other work included). The k tokens are new to the engine unless a call with the same
    `seed` asked for the same shape at the same position before (then they are cached, and the
    step computes one token); shapes of other sizes draw other tokens, so that a shorter one
    asked for first is never a cached prefix of a longer one. Timed at the live workers'
    priority."""
    return at_worker_priority(lambda: _measure_prefill(engine, shapes, seed))


def _measure_prefill(
    engine: Any, shapes: Sequence[tuple[int, int]], seed: int
) -> list[ComputeSample]:
    vocab = engine.loaded.config.vocab_size
    samples = []
    for i, (k, ctx) in enumerate(shapes):
        prefix = tokens(ctx, 1000 + i, vocab)
        if ctx:
            engine.generate([prefix + tokens(BLOCK_SIZE, 1, vocab)], greedy(1))
        seconds = []
        for repeat in range(PREFILL_REPEATS):
            # Seeded by the shape too: the ids of a draw are a prefix of a longer draw's from
            # the same seed, and a 128-token step timed after a 64-token one would compute 64.
            new = tokens(k, f"prefill {seed} {i} {k} {ctx} {repeat}", vocab)
            engine.add_request(prefix + new, greedy(1))
            seconds.append(timed_step(engine))
            while engine.has_unfinished():
                engine.step()
        samples.append(ComputeSample.of([(k, ctx)], statistics.median(seconds)))
    return samples


def measure_decode(engine: Any, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, float]]:
    """(sequences, sum of their contexts, seconds per step) of decode-only steps, timed at the
    live workers' priority."""
    return at_worker_priority(lambda: _measure_decode(engine, shapes))


def _measure_decode(engine: Any, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, float]]:
    vocab = engine.loaded.config.vocab_size
    out = []
    engine.generate([tokens(32, 3, vocab)], greedy(DECODE_STEPS))  # the first decodes warm up
    for i, (batch, ctx) in enumerate(shapes):
        for j in range(batch):
            engine.add_request(tokens(ctx, 5000 + 100 * i + j, vocab), greedy(DECODE_STEPS + 4))
        for _ in range(64):  # until every prompt is computed (one step each is typical)
            if all(r.num_computed_tokens >= r.num_prompt_tokens for r in _running(engine)):
                break
            engine.step()
        engine.step()  # the first decode step may still allocate
        seconds = [timed_step(engine) for _ in range(DECODE_STEPS)]
        while engine.has_unfinished():
            engine.step()
        out.append((batch, batch * (ctx + 2), sorted(seconds)[len(seconds) // 2]))
    return out


def _running(engine: Any) -> list[Any]:
    return [*engine.scheduler.waiting, *engine.scheduler.running]
