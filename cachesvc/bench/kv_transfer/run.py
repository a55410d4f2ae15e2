"""`cachesvc bench kv-transfer`: how fast KV moves between two workers, and what serving pulls
costs the holder's own decodes.

Part one, the paths: two Ray actors, each with a KV cache of the default model's shape, and
pulls of 1K–32K tokens between them. Each path is timed from the first call to the last block
landed in the puller's cache, and set against this machine's plain memory-copy bandwidth
measured in the same run:

- `pickled blobs` — the earlier path: the holder encodes block by block into bytes (codec
  `raw`), a tuple of them is pickled through Ray, the puller decodes and lands each;
- `object store (fast)` — the data plane (`workers.transfer`) between nodes: the holder gathers
  a chunk into a reused buffer and seals it off its loop, the payload is copied into Ray's
  object store and moves out of band as a numpy array, the puller checks the digest and lands
  the rows;
- `shared memory (fast)` / `shared memory (strict)` — the data plane within a node: the holder
  gathers the chunk straight into a shared-memory slot it leases to the puller, which checks and
  lands the rows in place and releases the slot (no copy into the object store). `fast` MACs a
  128-bit xxh3 of the payload, `strict` the payload itself.

Part two, the holder (`kv_transfer_holder`): two real workers; the holder decodes a long
stream while the other worker pulls a context from it again and again, and its inter-token
gaps are compared with the same stream decoded alone; the puller's planner's predicted pull
time is set against the measured one.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cachesvc.bench.kv_transfer.stages import format_stages, measure_stages
from cachesvc.kv.types import BlockId
from cachesvc.workloads.table import format_table, write_json

# The default model's KV (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32), 16-token blocks.
BLOCK_SHAPE = (30, 2, 16, 3, 64)
BLOCK_TOKENS = 16
CHUNK_BLOCKS = 32  # as a pull asks for them (`PULL_CHUNK_BLOCKS`)
SIZES = (1024, 4096, 16384, 32768)
QUICK_SIZES = (1024, 4096)
PATHS = ("pickled blobs", "object store (fast)", "shared memory (fast)", "shared memory (strict)")
RING_MB = 1024  # the holder's same-node slots (`peer_shm_mb`)


def _ids(lo: int, hi: int) -> list[BlockId]:
    return [BlockId(i) for i in range(lo, hi)]


@dataclass(frozen=True)
class PathResult:
    path: str
    tokens: int
    num_bytes: int
    seconds: float  # the best of the repeats

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's plain memory-copy bandwidth now (the best of `repeats` copies)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return num_bytes / best / 1e9


class BenchHolder:
    """A holder with a KV cache of random blocks; serves both paths as a worker does."""

    def __init__(self, num_blocks: int, digest: str) -> None:
        import ray
        import torch

        from workers.transfer.chunk import chunk_key
        from workers.transfer.staging import Stager
        from workers.transfer.threads import transfer_executor

        self.caches = list(torch.randn(BLOCK_SHAPE[0], num_blocks, *BLOCK_SHAPE[1:]).unbind(0))
        self.digest = digest
        self.key = chunk_key(None)
        self.fingerprint = "0" * 32
        self._exporting = asyncio.Semaphore(2)  # `peer_max_exports`
        node = ray.get_runtime_context().get_node_id()
        ring = RING_MB << 20
        self.stager = Stager(BLOCK_SHAPE, torch.float32, CHUNK_BLOCKS, CHUNK_BLOCKS, ring, node)
        self._threads = transfer_executor(2, "kv-export")
        self._hashed: tuple[int, list[Any]] = (-1, [])

    async def ready(self) -> bool:
        return True

    def hashes(self, token_ids: Sequence[int]) -> list[Any]:
        """The prompt's hashes, once per pull (as the exporter keeps them)."""
        from cachesvc.kv.hashing import hash_blocks, root_hash

        if self._hashed[0] != len(token_ids):
            root = root_hash(self.fingerprint, 16, "")
            ids = np.asarray(token_ids).tolist()
            self._hashed = (len(token_ids), hash_blocks(ids, BLOCK_TOKENS, root))
        return self._hashed[1]

    async def export_chunk(
        self, token_ids: Sequence[int], salt: Any, lo: int, hi: int, puller: Any = None
    ) -> Any:
        """The data plane's holder, as `ChunkExporter` serves it: on a transfer thread, a
        gather into a same-node slot or a reused buffer, the seal and (from a buffer) the put
        into the object store. (A worker first pins the run at a step boundary: no blocks move
        here, so there is nothing to pin.)"""
        from workers.engine.kv_copy import gather_blocks, kv_to_numpy
        from workers.peer.stage import StagedRun, seal

        hashes = tuple(self.hashes(token_ids)[lo:hi])
        async with self._exporting:
            staging = self.stager.take(puller, hi - lo)

            def copy_seal_ship() -> Any:
                gather_blocks(self.caches, _ids(lo, hi), staging.buffer[: hi - lo])
                rows = kv_to_numpy(staging.buffer[: hi - lo])
                staged = StagedRun(lo, "float32", rows, hashes)
                sealed = seal(staged, self.key, self.digest, self.fingerprint)
                return self.stager.ship(staging, sealed)

            try:
                loop = asyncio.get_running_loop()
                chunk = await loop.run_in_executor(self._threads, copy_seal_ship)
            except BaseException:
                self.stager.finish(staging, delivered=False)
                raise
            self.stager.finish(staging, delivered=True)
            return chunk

    async def release_slots(self, leases: Any) -> int:
        """A puller's release of the slots it is done with, as a worker ends their leases."""
        return self.stager.release(leases)

    async def noop(self, token_ids: Any, salt: Any, lo: int, hi: int, puller: Any = None) -> None:
        """A chunk's call that stages nothing: what a call costs by itself."""

    def counters(self) -> dict[str, float]:
        return self.stager.counters()

    async def export_blobs(self, token_ids: list[int], lo: int, hi: int) -> tuple[bytes, ...]:
        """The earlier path, on the holder's loop: a block at a time, encoded into bytes."""
        from cachesvc.kv.codec import Codec
        from workers.engine.kv_copy import read_block

        codec = Codec(self.fingerprint, "raw")
        hashes = self.hashes(token_ids)
        return tuple(
            codec.encode(
                hashes[i],
                hashes[i - 1] if i else None,
                "float32",
                read_block(self.caches, BlockId(i)),
            )
            for i in range(lo, hi)
        )


class BenchPuller:
    """Pulls from a `BenchHolder` over each path and lands the blocks in its own cache."""

    def __init__(self, num_blocks: int, namespace: str) -> None:
        import torch

        from workers.transfer.ray_link import RayPeerLink

        self.caches = list(torch.zeros(BLOCK_SHAPE[0], num_blocks, *BLOCK_SHAPE[1:]).unbind(0))
        self.namespace = namespace
        # The same link as a worker's: it offers the holder its process on the same node (the
        # shared-memory path), or not (every chunk through the object store).
        self.links = {
            "shared memory": RayPeerLink(namespace),
            "object store": RayPeerLink(namespace, local=False),
        }

    def pull(self, holder: str, path: str, num_blocks: int) -> float:
        """Seconds from asking to the last block landed; raises if a block fails to verify."""
        token_ids = list(range(num_blocks * BLOCK_TOKENS))
        chunks = [
            (lo, min(lo + CHUNK_BLOCKS, num_blocks)) for lo in range(0, num_blocks, CHUNK_BLOCKS)
        ]
        began = time.perf_counter()
        if path == "pickled blobs":
            self._pull_blobs(holder, token_ids, chunks)
        else:
            way, mode = path.rstrip(")").split(" (")
            self._pull_chunks(holder, token_ids, chunks, way, mode)
        return time.perf_counter() - began

    def _pull_chunks(
        self, holder: str, ids: list[int], chunks: list[tuple[int, int]], way: str, mode: str
    ) -> None:
        from cachesvc.kv.hashing import hash_blocks, root_hash
        from workers.engine.kv_copy import write_host
        from workers.transfer.chunk import chunk_key, verify_chunk

        hashes = hash_blocks(ids, BLOCK_TOKENS, root_hash("0" * 32, 16, ""))
        key = chunk_key(None)
        link = self.links[way]
        for chunk in link.fetch(holder, ids, None, chunks, time.monotonic() + 600):
            lo = chunk.start_block
            run = hashes[lo : lo + chunk.num_blocks]
            if not verify_chunk(chunk, key, mode, "0" * 32, run, BLOCK_SHAPE):
                raise RuntimeError(f"chunk at block {lo} did not verify")
            # The only copy on this side; the chunk's slot is released when it goes.
            write_host(self.caches, _ids(lo, lo + chunk.num_blocks), list(chunk.payload))

    def calls(self, holder: str, num_blocks: int) -> float:
        """Seconds for a pull's calls to the holder, made as a pull makes them, each answering
        nothing: the Ray calls' share of a pull."""
        import ray

        handle = ray.get_actor(holder, namespace=self.namespace)
        ids = np.arange(num_blocks * BLOCK_TOKENS, dtype=np.uint32)
        began = time.perf_counter()
        ref = ray.put(ids)
        asked: list[Any] = [
            handle.noop.remote(ref, None, lo, lo + CHUNK_BLOCKS, None)
            for lo in range(0, num_blocks, CHUNK_BLOCKS)
        ]
        for answer in asked:
            answer.future().result()
        return time.perf_counter() - began

    def _pull_blobs(self, holder: str, ids: list[int], chunks: list[tuple[int, int]]) -> None:
        import ray

        from cachesvc.kv.codec import Codec
        from cachesvc.kv.hashing import hash_blocks, root_hash
        from workers.engine.kv_copy import write_host

        hashes = hash_blocks(ids, BLOCK_TOKENS, root_hash("0" * 32, 16, ""))
        codec = Codec("0" * 32, "raw")
        handle = ray.get_actor(holder, namespace=self.namespace)
        refs: list[Any] = [handle.export_blobs.remote(ids, lo, hi) for lo, hi in chunks]
        for (lo, _), ref in zip(chunks, refs, strict=True):
            blobs: tuple[bytes, ...] = ray.get(ref)
            blocks = [codec.decode(b, hashes[lo + i]) for i, b in enumerate(blobs)]
            if any(b is None for b in blocks):
                raise RuntimeError(f"a block of the chunk at {lo} did not verify")
            write_host(self.caches, _ids(lo, lo + len(blocks)), [b.array for b in blocks])  # type: ignore[union-attr]


def run_paths(sizes: Sequence[int], repeats: int) -> tuple[list[PathResult], float]:
    """Every path at every size, between two actors of the connected Ray cluster, the repeats
    taken in turns (a noisy moment costs every path alike); and the seconds of the largest
    pull's Ray calls by themselves."""
    import ray

    namespace = ray.get_runtime_context().namespace
    max_blocks = max(sizes) // BLOCK_TOKENS
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    options = {"num_cpus": 0, "max_concurrency": 8, "namespace": namespace}
    holder_cls: Any = ray.remote(BenchHolder)
    puller_cls: Any = ray.remote(BenchPuller)
    holders = {
        mode: holder_cls.options(name=f"bench-holder-{mode}", **options).remote(max_blocks, mode)
        for mode in ("fast", "strict")
    }
    puller = puller_cls.options(**options).remote(max_blocks, namespace)
    ray.get([h.ready.remote() for h in holders.values()])
    results: list[PathResult] = []
    for tokens in sizes:
        n = tokens // BLOCK_TOKENS
        names = {path: f"bench-holder-{'strict' if 'strict' in path else 'fast'}" for path in PATHS}
        for path in PATHS:  # a warm-up pull of the whole size: the holder's slots get made
            ray.get(puller.pull.remote(names[path], path, n if "shared" in path else 1))
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for _ in range(repeats):
            for path in PATHS:
                times[path].append(ray.get(puller.pull.remote(names[path], path, n)))
        for path in PATHS:
            results.append(PathResult(path, tokens, n * block_bytes, min(times[path])))
            print(f"  {path:24s} {tokens:6d} tokens: {results[-1].gbps:.2f} GB/s", file=sys.stderr)
    call_s = min(ray.get(puller.calls.remote("bench-holder-fast", max_blocks)) for _ in range(3))
    for actor in (*holders.values(), puller):
        ray.kill(actor)
    return results, call_s


def format_paths(results: Sequence[PathResult], copy_gbps: float) -> str:
    by = {(r.path, r.tokens): r for r in results}
    rows = []
    for r in results:
        base = by.get(("pickled blobs", r.tokens))
        rows.append(
            [
                r.tokens,
                r.path,
                f"{r.num_bytes / 2**20:.0f}",
                f"{r.seconds * 1000:.0f}",
                f"{r.gbps:.2f}",
                f"{r.gbps / copy_gbps:.0%}",
                f"{base.seconds / r.seconds:.1f}x" if base else "-",
            ]
        )
    headers = ["tokens", "path", "MiB", "ms", "GB/s", "of memcpy", "vs pickled"]
    return f"memory copy here: {copy_gbps:.2f} GB/s\n" + format_table(headers, rows)


def run_kv_transfer_bench(
    quick: bool, json_path: str | None, with_holder: bool = True, model: str | None = None
) -> int:
    """Blocking entry point; prints the tables, returns 0."""
    import ray

    sizes = QUICK_SIZES if quick else SIZES
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        copy_gbps = memcpy_gbps()
        print("pull paths:", file=sys.stderr)
        paths, call_s = run_paths(sizes, repeats=2 if quick else 3)
        stages = measure_stages(max(sizes) // BLOCK_TOKENS, BLOCK_SHAPE, CHUNK_BLOCKS, call_s)
        copy_after = memcpy_gbps()
        copy = max(copy_gbps, copy_after)
        print("\nKV between two workers, best of the repeats:")
        print(format_paths(paths, copy))
        print("\nwhat each stage of the largest pull costs, and the bound they set here:")
        print(format_stages(stages, copy))
        holder: dict[str, Any] = {}
        if with_holder:
            from cachesvc.bench.kv_transfer.holder import format_holder, run_holder

            holder = run_holder(quick, model)
            print("\nthe holder's own decode while it serves pulls:")
            print(format_holder(holder))
    finally:
        ray.shutdown()
    write_json(
        json_path,
        {
            "memcpy_gbps": copy,
            "paths": [asdict(p) | {"gbps": p.gbps} for p in paths],
            "stages": asdict(stages),
            "holder": holder,
        },
    )
    return 0
