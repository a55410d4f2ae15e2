"""The prefill schemes' costs measured where a worker starts, cached per machine and backend.

The built-in rule in `schemes.py` carries nanosecond constants measured on one machine; another
CPU (or a GPU) ranks the schemes differently. `scheme_costs` times every scheme's attention on a
small P x S x M grid of shared-prefix cases (`scheme_cases`, the steps the prefill-schemes
benchmark times) with the worker's backend, device, dtype, heads and page size, and returns the
cells as `SchemeCosts` for `choose_scheme`. The cells are kept in a JSON file under a key of all
of that plus the machine, torch's version and torch's thread count, next to the paged-decode
kernel's cache: the next start on the same machine reads them back in milliseconds. When
calibration is off, or it fails, `scheme_costs` returns None and the built-in rule decides.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from workers.attention.scheme_cases import make_case, run_scheme, scheme_run
from workers.attention.schemes import SCHEMES, SchemeCosts
from workers.config import SCHEME_CALIBRATIONS

logger = logging.getLogger(__name__)

# Part of the cache key: change it whenever the grid or the timing below changes meaning.
# (The attention kernels' sources are part of it too: `_kernel_sources`.)
_VERSION = 2

Grid = tuple[Sequence[int], Sequence[int], Sequence[int]]
# Levels 4x apart in P and 16x in S and M span what one prefill step holds (2K tokens by
# default); between levels `SchemeCosts.estimate` interpolates. On this project's 2-core build
# machine, one thread, quiet: 2 s for the tiny test model's heads, 8 s for SmolLM2's (9/3 x 64),
# 25 s for the benchmark's 16/8 x 128; several times that while other work loads the machine.
CPU_GRID: Grid = ((64, 256, 1024), (4, 64), (2, 8))
# A GPU computes these in milliseconds: the seed's range (P to 8K, S to 256, M to 32).
GPU_GRID: Grid = ((64, 512, 8192), (4, 64, 256), (2, 8, 32))


@dataclass(frozen=True)
class CalibrationTarget:
    """What the costs are measured for: one backend on one device, one model's attention."""

    backend: str
    device: str
    dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    # The P, S and M levels to measure; None: CPU_GRID or GPU_GRID by device.
    grid: Grid | None = None

    @property
    def sm_scale(self) -> float:
        return float(self.head_dim) ** -0.5

    @property
    def levels(self) -> Grid:
        """The grid measured: `grid`, or the device's default."""
        if self.grid is not None:
            return self.grid
        return GPU_GRID if self.device.startswith("cuda") else CPU_GRID

    def key(self) -> dict[str, Any]:
        """Everything the measured costs depend on; a cache under another key is not used."""
        fields = {**asdict(self), "dtype": str(self.dtype)}
        return {
            **fields,
            "machine": _machine(self.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "grid": [list(levels) for levels in self.levels],
            "version": _VERSION,
            "kernels": _kernel_sources(),
        }


def _kernel_sources() -> str:
    """A digest of the CPU attention kernels' sources, their headers and the shared ones
    included: costs measured with other kernels are stale."""
    digest = hashlib.sha256()
    own = Path(__file__).parent / "csrc"
    shared = Path(__file__).parents[1] / "kernels" / "csrc"  # claim.h, vec_math.h
    for source in [
        *sorted(own.glob("*.cpp")),
        *sorted(own.glob("*.h")),
        *sorted(shared.glob("*.h")),
    ]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _machine(device: str) -> str:
    """The host and its CPU's vector level, or the GPU's name: costs differ between them."""
    cpu = f"{platform.node()} {platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    if device.startswith("cuda"):
        return f"{cpu} {torch.cuda.get_device_name(torch.device(device))}"
    return f"{cpu} x{os.cpu_count()}"


def default_cache_dir() -> Path:
    """A writable folder that survives the process: inside the virtualenv, else ~/.cache."""
    venv = Path(sys.prefix)
    if sys.prefix != sys.base_prefix and os.access(venv, os.W_OK):
        return venv / "var" / "cachesvc-scheme-costs"
    return Path.home() / ".cache" / "cachesvc" / "scheme-costs"


def cache_path(key: Mapping[str, Any], cache_dir: Path) -> Path:
    """The file of `key`'s costs: a digest of the key, so a changed key misses."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{digest}.json"


def load_costs(path: Path, key: Mapping[str, Any]) -> SchemeCosts | None:
    """The costs stored at `path` for `key`; None when the file is absent, unreadable, not
    ours (another key) or incomplete. Never raises for a bad file."""
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != json.loads(json.dumps(key)):
            return None
        costs = SchemeCosts.from_records(stored["cells"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring the scheme costs at %s (%s)", path, exc)
        return None
    complete = costs.cells and all(set(c.ms) == set(SCHEMES) for c in costs.cells)
    return costs if complete else None


def save_costs(path: Path, key: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]) -> None:
    """Write the cells under `key`, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump({"key": key, "cells": list(cells)}, f, indent=1)
    Path(f.name).replace(path)


def scheme_costs(
    target: CalibrationTarget, mode: str = "auto", cache_dir: Path | None = None
) -> SchemeCosts | None:
    """Measured costs for `target`: cached ones ("auto"), re-measured ("refresh"), or None
    ("off", or when measuring fails: `choose_scheme` then falls back to its built-in rule).

    Blocks for the measurement (seconds) unless the cache answers; processes starting together
    measure once, under a file lock, and the others read the result.
    """
    if mode not in SCHEME_CALIBRATIONS:
        raise ValueError(f"scheme calibration must be one of {SCHEME_CALIBRATIONS}: {mode!r}")
    if mode == "off":
        return None
    try:
        key = target.key()
        path = cache_path(key, cache_dir or default_cache_dir())
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.with_suffix(".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            costs = load_costs(path, key) if mode == "auto" else None
            if costs is not None:
                return costs
            cells = calibrate(target)
            save_costs(path, key, cells)
            return SchemeCosts.from_records(cells)
    # A backend that cannot run here (ValueError, RuntimeError: no CUDA or package, ImportError),
    # a kernel that fails, a cache folder that cannot be written: the worker still serves, with
    # the built-in rule. Anything else (a caller's timeout) propagates.
    except (ValueError, RuntimeError, ImportError, OSError, AssertionError) as exc:
        logger.warning("prefill scheme calibration failed (%s); using the built-in rule", exc)
        return None


def calibrate(target: CalibrationTarget) -> list[dict[str, Any]]:
    """Time every scheme on each cell of `target.levels`; records as `SchemeCosts` reads them."""
    start = time.perf_counter()
    cells = []
    for p in target.levels[0]:
        for s in target.levels[1]:
            for m in target.levels[2]:
                ms = measure_cell(p, s, m, target)
                cells.append(
                    {"P": p, "S": s, "M": m, "backend": target.backend, "decode": False, "ms": ms}
                )
    logger.info(
        "prefill schemes calibrated for %s on %s in %.1f s (%d cells)",
        target.backend,
        target.device,
        time.perf_counter() - start,
        len(cells),
    )
    return cells


def measure_cell(
    p: int,
    s: int,
    m: int,
    target: CalibrationTarget,
    *,
    min_rounds: int = 3,
    max_rounds: int = 8,
    seconds: float = 0.3,
    keep_within: float = 2.0,
) -> dict[str, float]:
    """Each scheme's ms on one `[P | S] x M` case: its fastest of several rounds, after one
    warm-up call each.

    The fastest, not the median: on a shared machine a stall only ever adds time, so the
    minimum is the steadiest estimate of what a scheme costs. Rounds run the schemes in a
    shuffled order (a load change slows them alike), at least `min_rounds`, more while the cell
    has taken under `seconds`. From the third round on, a scheme whose best is over
    `keep_within` x the best scheme's stops running (naive at a long prefix, a mask scheme at
    long suffixes): it cannot win, and its best so far is kept.
    """
    case = make_case(p, s, m, target, seed=p * 1000 + s * 10 + m)
    runs = {scheme: scheme_run(scheme, case, target.backend) for scheme in SCHEMES}
    fns = {k: partial(run_scheme, run, case.kv_cache, target.sm_scale) for k, run in runs.items()}
    sync = torch.cuda.synchronize if target.device.startswith("cuda") else _no_sync
    for fn in fns.values():
        fn()
    best: dict[str, float] = dict.fromkeys(fns, math.inf)
    names = list(fns)
    order = random.Random(p + s + m)
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < seconds and rounds < max_rounds):
        order.shuffle(names)
        for name in names:
            sync()
            begin = time.perf_counter()
            fns[name]()
            sync()
            best[name] = min(best[name], (time.perf_counter() - begin) * 1e3)
        rounds += 1
        # Late and loose: a scheme stalled in its first rounds (a shared machine) must not be
        # dropped with a time it owes to the stall.
        if rounds >= min_rounds:
            fastest = min(best.values())
            names = [n for n in names if best[n] <= keep_within * fastest]
    return best


def _no_sync() -> None:
    pass
