"""`cachesvc bench router`: what one routing decision costs the router process, per stage.

The decision path alone, without workers: the stages `router/core.py` runs before forwarding a
request, each with the router's own code — tokenize the text (the default model's tokenizer,
as `router.bootstrap` loads it), hash the blocks (`cachesvc.kv.hashing`, the workers' keys), look
up the longest cached prefix per worker (`MemoryPrefixIndex`, filled as a busy cluster's would
be) and choose (`prefix_aware`). Timed one request at a time, at 1K, 8K and 32K-token prompts;
requests per second is what one process sustains doing nothing else (1 / mean decision time).
A live run against workers would add the gRPC and Ray hops, which do not depend on the prompt.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.kv.types import BlockHash, WorkerId
from cachesvc.workloads.table import format_table, percentile, write_json
from router.policy.routing import Candidate, RouteRequest, choose_and_record, make_policy

SIZES = (1024, 8192, 32768)
BLOCK_SIZE = 16
NUM_WORKERS = 8
STAGES = ("tokenize", "hash", "lookup", "choose")
_FIRST_WORD_ID = 1000  # clear of special and byte tokens


@dataclass(frozen=True)
class OverheadResult:
    """One prompt size: per-stage and total milliseconds per decision."""

    prompt_tokens: int
    num_decisions: int
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    requests_per_s: float


def _text_of(tokenizer: Any, num_tokens: int, rng: random.Random) -> str:
    """A text of about `num_tokens` tokens: random words of the vocabulary, decoded."""
    ids = [rng.randrange(_FIRST_WORD_ID, tokenizer.vocab_size) for _ in range(num_tokens)]
    return str(tokenizer.decode(ids))


def _busy_index(prompts: Sequence[list[BlockHash]], rng: random.Random) -> MemoryPrefixIndex:
    """Every worker holds 64K other blocks; each prompt's prefix is held by three workers to
    different depths, so a lookup walks the prompt as it would in a busy cluster."""
    index = MemoryPrefixIndex()
    for w in range(NUM_WORKERS):
        held = [BlockHash(rng.randbytes(16)) for _ in range(65536)]
        for hashes in prompts:
            depth = len(hashes) * (w + 1) // NUM_WORKERS if w % 3 == 0 else 0
            held.extend(hashes[:depth])
        index.resync(WorkerId(f"w{w}"), IndexSnapshot("bench", 0, {"hbm": held}))
    return index


def measure(tokenizer: Any, num_tokens: int, num_prompts: int, repeats: int) -> OverheadResult:
    """Decisions over `num_prompts` distinct texts of about `num_tokens` tokens, each routed
    `repeats` times."""
    rng = random.Random(num_tokens)
    texts = [_text_of(tokenizer, num_tokens, rng) for _ in range(num_prompts)]
    root = root_hash("bench-model", BLOCK_SIZE)
    index = _busy_index([hash_blocks(tokenizer.encode(t), BLOCK_SIZE, root) for t in texts], rng)
    policy = make_policy("prefix_aware")
    workers = [WorkerId(f"w{w}") for w in range(NUM_WORKERS)]
    times: dict[str, list[float]] = {s: [] for s in (*STAGES, "total")}
    lengths = []
    clock = time.perf_counter
    for _ in range(repeats):
        for text in texts:
            t0 = clock()
            ids = tokenizer.encode(text)
            t1 = clock()
            hashes = hash_blocks(ids, BLOCK_SIZE, root)
            t2 = clock()
            matches = index.longest_prefix(hashes)
            t3 = clock()
            candidates = [
                Candidate(w, i % 4, 1000 * (i % 3), matches.get(w)) for i, w in enumerate(workers)
            ]
            choose_and_record(policy, RouteRequest(len(ids), BLOCK_SIZE), candidates)
            t4 = clock()
            marks = (t0, t1, t2, t3, t4)
            for stage, start, end in zip(STAGES, marks, marks[1:], strict=False):
                times[stage].append((end - start) * 1e3)
            times["total"].append((t4 - t0) * 1e3)
            lengths.append(len(ids))
    mean_ms = sum(times["total"]) / len(times["total"])
    return OverheadResult(
        prompt_tokens=round(sum(lengths) / len(lengths)),
        num_decisions=len(lengths),
        p50_ms={s: percentile(v, 50) for s, v in times.items()},
        p99_ms={s: percentile(v, 99) for s, v in times.items()},
        requests_per_s=1e3 / mean_ms if mean_ms else 0.0,
    )


def format_results(results: Sequence[OverheadResult]) -> str:
    headers = ["prompt tok", "decisions"]
    headers += [f"{s} p50/p99 ms" for s in (*STAGES, "total")] + ["req/s"]
    rows = [
        [
            r.prompt_tokens,
            r.num_decisions,
            *[f"{r.p50_ms[s]:.3f} / {r.p99_ms[s]:.3f}" for s in (*STAGES, "total")],
            r.requests_per_s,
        ]
        for r in results
    ]
    return format_table(headers, rows)


def run_router_overhead_bench(quick: bool, json_path: str | None) -> int:
    """Blocking entry point of `cachesvc bench router`; prints the table, returns 0."""
    from router.bootstrap import load_router_tokenizer

    tokenizer = load_router_tokenizer(None)
    if tokenizer is None:
        raise ValueError("the default model ships no tokenizer")
    results = []
    for size in SIZES:
        num_prompts, repeats = (4, 5) if quick else (16, 10)
        if size >= 32768:
            num_prompts = max(2, num_prompts // 2)
        results.append(measure(tokenizer, size, num_prompts, repeats))
        print(f"  {size} tokens: done", file=sys.stderr, flush=True)
    print(f"decision path alone (no workers), {NUM_WORKERS} workers in the index, one process:")
    print(format_results(results))
    write_json(json_path, [r.__dict__ for r in results])
    return 0
