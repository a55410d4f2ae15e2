"""Part of `cachesvc bench kv-transfer`: what each stage of a pull costs on one core, and the
bound the stages set on this machine.

A pull through a same-node slot does at least: the holder's gather into the slot (a copy), its
seal (a pass of xxh3 over the payload), the puller's check (another pass) and its landing into
its KV cache (a copy), plus one Ray call per chunk; the object-store path adds the copy into
the store. Each stage is timed here over a whole pull, chunk by chunk, on one thread (as a
worker runs it), the best of the repeats. However well a pull overlaps its stages, it cannot
take less than their sum spread over the host's cores: that is the bound a path can reach here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachesvc.workloads.table import format_table

SLOT_STAGES = ("gather into a slot", "seal (fast)", "check (fast)", "land", "Ray calls")
STORE_STAGE = "put into the object store"


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one core each stage takes for a pull of `num_bytes` in `num_chunks` chunks."""

    num_bytes: int
    num_chunks: int
    seconds: dict[str, float]

    def bound_gbps(self, stages: tuple[str, ...], cores: int) -> float:
        """The best a path made of `stages` can do on `cores` cores: their work, split evenly."""
        return self.num_bytes / (sum(self.seconds[s] for s in stages) / cores) / 1e9


def measure_stages(
    num_blocks: int,
    block_shape: tuple[int, ...],
    chunk_blocks: int,
    call_s: float,
    repeats: int = 3,
) -> StageCosts:
    """Time every stage of a pull of `num_blocks` float32 blocks of `block_shape` in chunks of
    `chunk_blocks` (a Ray driver must be connected: the put goes into its object store);
    `call_s` is the measured cost of the pull's Ray calls (`BenchPuller.calls`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs
    try:
        runs = [_one_pull(num_blocks, block_shape, chunk_blocks) for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    seconds = {stage: min(run[stage] for run in runs) for stage in runs[0]}
    seconds["Ray calls"] = call_s
    num_bytes = num_blocks * int(np.prod(block_shape)) * 4
    return StageCosts(num_bytes, -(-num_blocks // chunk_blocks), seconds)


def _one_pull(num_blocks: int, shape: tuple[int, ...], chunk: int) -> dict[str, float]:
    """Each stage's seconds over one pull, its chunks staged in one reused slot."""
    import ray
    import torch

    from cachesvc.kv.hashing import hash_blocks, root_hash
    from cachesvc.kv.types import BlockId
    from workers.engine.kv_copy import gather_blocks, kv_to_numpy, write_host
    from workers.peer.stage import StagedRun, seal
    from workers.transfer.chunk import chunk_key, verify_chunk
    from workers.transfer.slots import this_process
    from workers.transfer.staging import Stager

    caches = list(torch.randn(shape[0], num_blocks, *shape[1:]).unbind(0))
    landed = list(torch.zeros(shape[0], num_blocks, *shape[1:]).unbind(0))
    block_bytes = int(np.prod(shape)) * 4
    stager = Stager(shape, torch.float32, chunk, chunk, chunk * block_bytes, "bench")
    staging = _slot(stager, this_process("bench"), chunk)
    key, fingerprint = chunk_key(None), "0" * 32
    hashes = hash_blocks(list(range(num_blocks * 16)), 16, root_hash(fingerprint, 16, ""))
    spent = dict.fromkeys((*SLOT_STAGES[:4], STORE_STAGE), 0.0)
    for lo in range(0, num_blocks, chunk):
        ids = [BlockId(i) for i in range(lo, min(lo + chunk, num_blocks))]
        rows = staging.buffer[: len(ids)]
        spent["gather into a slot"] += _timed(gather_blocks, caches, ids, rows)
        run = tuple(hashes[lo : lo + len(ids)])
        staged = StagedRun(lo, "float32", kv_to_numpy(rows), run)
        sealed = seal(staged, key, "fast", fingerprint)
        spent["seal (fast)"] += _timed(seal, staged, key, "fast", fingerprint)
        spent["check (fast)"] += _timed(verify_chunk, sealed, key, "fast", fingerprint, run, shape)
        spent["land"] += _timed(write_host, landed, ids, list(sealed.payload))
        spent[STORE_STAGE] += _timed(ray.put, sealed.payload)
    stager.close()
    return spent


def _slot(stager: Any, puller: Any, num_blocks: int) -> Any:
    """Room in a slot, once the ring made one (it makes them on a thread of its own)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        staging = stager.take(puller, num_blocks)
        if staging.slot is not None:
            return staging
        stager.finish(staging, delivered=False)
        time.sleep(0.01)
    raise RuntimeError("no slot was made")


def _timed(fn: Callable[..., object], *args: Any) -> float:
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


def format_stages(costs: StageCosts, copy_gbps: float) -> str:
    """The stages' table, then each path's bound on this host's cores."""
    rows = []
    for stage, seconds in costs.seconds.items():
        rate = "-" if stage == "Ray calls" else f"{costs.num_bytes / seconds / 1e9:.2f}"
        rows.append([stage, rate, f"{seconds * 1000:.0f}"])
    mib = costs.num_bytes / 2**20
    headers = ["stage (one core)", "GB/s", f"ms for {mib:.0f} MiB in {costs.num_chunks} chunks"]
    cores = os.cpu_count() or 1
    lines = [format_table(headers, rows)]
    paths = {"shared memory": SLOT_STAGES, "object store": (*SLOT_STAGES, STORE_STAGE)}
    for path, stages in paths.items():
        bound = costs.bound_gbps(stages, cores)
        lines.append(
            f"{path}: at best {bound:.2f} GB/s on {cores} cores "
            f"({bound / copy_gbps:.0%} of the memory copy), every stage overlapped perfectly"
        )
    return "\n".join(lines)
