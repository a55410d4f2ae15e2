"""Where one engine step's time goes: perf_counter clocks around a live `Engine`'s parts.

`instrument(engine)` wraps, for as long as the context lasts, the callables a step goes through
(instance attributes where the engine holds an instance; the runner's module-level `plan_step`
and `sample`, which it looks up at each call) and forward hooks on the model. Nothing is added
to the engine's code: outside the context it runs unclocked. Each clock counts only its
outermost call, so a phase that calls itself (cascade's levels through `forward`) counts once.

The phases are exclusive, so they add up to at most the step; `other` is the rest of the step
(Python glue: building tensors from the batch, stop checks, output snapshots). `stream` is
clocked by the bench itself, outside the step (the worker's deltas); `host` sums what is not
the model's (`HOST_PHASES`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from workers.text.detokenizer import IncrementalDetokenizer

# Inclusive clocks, one per wrapped part.
_CLOCKS = (
    "step",
    "schedule",
    "layout",
    "model",
    "attention",
    "kv_write",
    "gather",
    "sampling",
    "detokenize",
    "stream",
)
# Exclusive phases, as reported: name -> what it holds.
PHASES = {
    "schedule": "scheduler and block bookkeeping (schedule, update, evictions)",
    "layout": "block tables to index tensors (plan_step, backend plan)",
    "weights": "the layers' matmuls and elementwise ops (model minus attention)",
    "attn_gather": "copying the context's pages out of the cache (gather path only)",
    "attn_compute": "attention proper over the context",
    "kv_write": "writing the new tokens' K/V into their pages",
    "sampling": "sampling the next tokens",
    "detokenize": "token ids to text deltas",
}
# The host's work per step: the phases outside the model, the rest of the step (Python glue),
# and, outside the step, the worker's stream deltas (`stream`: built and pickled, as its actor
# ships them through Ray).
HOST_PHASES = ("schedule", "layout", "sampling", "detokenize", "other", "stream")
# Clocks that also read the thread's CPU time: on a shared machine, wall time counts the waits
# for a core, CPU time does not (with one torch thread, the model computes on this thread too).
# `host_cpu` = step - model + stream, in CPU seconds.
_CPU_CLOCKS = ("step", "model", "stream")


@dataclass
class PhaseClock:
    """Seconds per clock since the last `take()`, counting outermost calls only."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_CLOCKS, 0.0))
    _depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CLOCKS, 0))
    cpu_totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_CPU_CLOCKS, 0.0))
    _started: dict[str, float] = field(default_factory=dict)
    _cpu_started: dict[str, float] = field(default_factory=dict)

    def start(self, clock: str) -> None:
        self._depth[clock] += 1
        if self._depth[clock] == 1:
            self._started[clock] = time.perf_counter()
            if clock in self.cpu_totals:
                self._cpu_started[clock] = time.thread_time()

    def stop(self, clock: str) -> None:
        self._depth[clock] -= 1
        if self._depth[clock] == 0:
            if clock in self.cpu_totals:
                self.cpu_totals[clock] += time.thread_time() - self._cpu_started.pop(clock)
            self.totals[clock] += time.perf_counter() - self._started.pop(clock)

    def timed(self, clock: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.start(clock)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(clock)

        return wrapper

    def take(self) -> dict[str, float]:
        """The exclusive phases (seconds) since the last take, with `step` and `other`; resets."""
        t = self.totals
        attention = t["attention"] + t["kv_write"]
        phases = {
            "schedule": t["schedule"],
            "layout": t["layout"],
            "weights": max(t["model"] - attention, 0.0),
            "attn_gather": t["gather"],
            "attn_compute": max(t["attention"] - t["gather"], 0.0),
            "kv_write": t["kv_write"],
            "sampling": t["sampling"],
            "detokenize": t["detokenize"],
        }
        phases["step"] = t["step"]
        phases["other"] = max(t["step"] - sum(phases[p] for p in PHASES), 0.0)
        phases["stream"] = t["stream"]
        phases["host"] = sum(phases[p] for p in HOST_PHASES)
        cpu = self.cpu_totals
        phases["host_cpu"] = max(cpu["step"] - cpu["model"], 0.0) + cpu["stream"]
        self.totals = dict.fromkeys(_CLOCKS, 0.0)
        self.cpu_totals = dict.fromkeys(_CPU_CLOCKS, 0.0)
        return phases


@contextmanager
def _wrap(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]):
    """Replace `owner.name` by `wrapper(owner.name)` until the context exits."""
    had_own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # back to the class's attribute


def _backend_parts(backend: Any) -> list[Any]:
    """The scheme backend and the plain backends inside it (each level's own instance)."""
    parts = [backend]
    for attr in ("inner", "shared"):
        inner = getattr(backend, attr, None)
        if inner is not None and all(inner is not p for p in parts):
            parts.append(inner)
    return parts


@contextmanager
def instrument(engine: Any, clock: PhaseClock, backends: list[Any]) -> Iterator[None]:
    """Clock `engine`'s step, split by phase, into `clock` while the context lasts.

    `backends`: every (scheme) backend the runner may be given meanwhile; each is clocked.
    """
    import workers.engine.runner as runner_module

    with ExitStack() as stack:

        def wrap(owner: Any, name: str, clock_name: str) -> None:
            stack.enter_context(_wrap(owner, name, lambda fn: clock.timed(clock_name, fn)))

        wrap(engine, "step", "step")
        wrap(engine.scheduler, "schedule", "schedule")
        wrap(engine.scheduler, "update", "schedule")
        wrap(engine.cache_admin, "after_evictions", "schedule")
        wrap(runner_module, "plan_step", "layout")
        # The runner samples a batch through one module-level function (per-row errors kept
        # apart, or not); whichever it has. Without one, sampling counts as `other`.
        for name in ("_sample_each", "sample"):
            if hasattr(runner_module, name):
                wrap(runner_module, name, "sampling")
                break
        if engine.tokenizer is not None:
            wrap(engine.tokenizer, "decode", "detokenize")  # a beam's text, the window path's
            # The streams' detokenizers (their byte-level path calls no `decode`).
            wrap(IncrementalDetokenizer, "add", "detokenize")
            wrap(IncrementalDetokenizer, "finish", "detokenize")
        for backend in backends:
            wrap(backend, "plan", "layout")
            wrap(backend, "forward", "attention")
            wrap(backend, "write_kv", "kv_write")
            for part in _backend_parts(backend)[1:]:
                if hasattr(part, "read_pages"):
                    wrap(part, "read_pages", "gather")
        model = engine.runner.model
        pre = model.register_forward_pre_hook(lambda *_: clock.start("model"))
        post = model.register_forward_hook(lambda *_: clock.stop("model"))
        stack.callback(pre.remove)
        stack.callback(post.remove)
        yield
