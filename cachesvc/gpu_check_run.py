"""The GPU check's run record and phase time caps (used by `cachesvc.gpu_check`)."""

from __future__ import annotations

import json
import signal
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

# Tolerances against float32 (research notes §10): output atol = rtol, base-2 LSE atol.
TOLERANCE = {torch.float16: (4e-3, 1e-2), torch.bfloat16: (2e-2, 1e-2)}


T = TypeVar("T")


class PhaseTimeout(Exception):
    """A phase ran past its cap."""


@contextmanager
def time_cap(seconds: int) -> Iterator[None]:
    """Raise PhaseTimeout in the main thread after `seconds` (checked between Python calls)."""

    def expire(signum: int, frame: object) -> None:
        raise PhaseTimeout(f"over its {seconds} s cap")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Run:
    """The options of this run and everything recorded so far (saved after each phase)."""

    out: Path
    backend: str
    device: str
    quick: bool
    model: str | None
    results: dict[str, Any]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")

    def check(self, name: str, ok: bool, error: str = "", **numbers: float) -> None:
        entry: dict[str, Any] = {"name": name, "ok": bool(ok), **numbers}
        if error:
            entry["error"] = error
        self.results.setdefault("checks", []).append(entry)
        detail = " ".join(f"{k}={v:.3g}" for k, v in numbers.items())
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {detail} {error}", flush=True)

    def guarded(self, name: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None after recording its exception as a failed check (caps still apply)."""
        try:
            return fn()
        except PhaseTimeout:
            raise
        except Exception as err:
            traceback.print_exc()
            self.check(name, False, error=f"{type(err).__name__}: {err}"[:400])
            return None
