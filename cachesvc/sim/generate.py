"""A generated Mooncake-format trace whose traffic grows with the cluster: the same rate of
requests per worker, so a sweep over workers compares clusters under the same load each.

A bigger cluster serves more users, not the same users faster: the trace draws more sessions of
the same shapes, each at its own pace. Two shapes, mixed:

- conversations: one of a few system prompts (Zipf popularity), then turns whose prompts grow
  by the last answer and a new message, a think time apart;
- agents: one of many tool prompts (Zipf popularity, a few blocks to tens of blocks), the
  agent's own task, then follow-ups that extend it.

Hash ids stand for blocks of `MOONCAKE_BLOCK_TOKENS` tokens, as in the real traces; rows are
what `load_trace` reads (`write_trace` saves them, for other tools or a later replay).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachesvc.workloads.sessions import MOONCAKE_BLOCK_TOKENS, TraceRow


@dataclass(frozen=True)
class GeneratedTrace:
    """The shape of a generated trace: sessions start at a steady rate that makes
    `rate_per_worker` requests per second per worker once under way, for `duration_s` seconds
    (the requests after that are left out)."""

    rate_per_worker: float = 0.5
    duration_s: float = 300.0
    seed: int = 0
    agent_fraction: float = 0.4  # sessions that are agents rather than conversations
    num_system_prompts: int = 8
    system_blocks: int = 4
    num_tool_prompts: int = 200
    tool_blocks: tuple[int, int] = (4, 40)  # a tool prompt's length, uniform
    zipf_s: float = 1.1  # popularity of system and tool prompts
    mean_turns: float = 4.0  # requests per session (geometric)
    first_blocks: tuple[int, int] = (2, 30)  # a session's own first message, uniform
    turn_blocks: tuple[int, int] = (1, 8)  # each later message, uniform
    mean_output: int = 150  # tokens per answer (exponential, at least 1)
    think_s: float = 30.0  # mean gap between a session's turns (exponential)

    def __post_init__(self) -> None:
        if self.rate_per_worker <= 0 or self.duration_s <= 0:
            raise ValueError("a generated trace needs a positive --rate-per-worker and duration")
        if not 0 <= self.agent_fraction <= 1 or self.mean_turns < 1:
            raise ValueError("agent_fraction must be in [0, 1] and mean_turns >= 1")


def generate_rows(shape: GeneratedTrace, num_workers: int) -> list[TraceRow]:
    """The trace for a cluster of `num_workers`, in arrival order (deterministic per seed)."""
    rng = random.Random(shape.seed)
    ids = _Ids()
    systems = [ids.take(shape.system_blocks) for _ in range(shape.num_system_prompts)]
    tools = [ids.take(rng.randint(*shape.tool_blocks)) for _ in range(shape.num_tool_prompts)]
    session_rate = shape.rate_per_worker * num_workers / shape.mean_turns
    rows: list[TraceRow] = []
    start = rng.expovariate(session_rate)
    while start < shape.duration_s:
        agent = rng.random() < shape.agent_fraction
        pool = tools if agent else systems
        prefix = pool[_zipf(rng, len(pool), shape.zipf_s)]
        rows.extend(_session(rng, ids, shape, start, prefix))
        start += rng.expovariate(session_rate)
    # Sessions that started near the end would run on past it at a thinning rate: cut there.
    rows = [r for r in rows if r.timestamp_ms < shape.duration_s * 1e3]
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


def write_trace(rows: Sequence[TraceRow], path: str | Path) -> None:
    """Save `rows` as a Mooncake JSONL trace (timestamps in ms)."""
    lines = (
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in rows
    )
    Path(path).write_text("\n".join(lines) + "\n")


class _Ids:
    """Fresh hash ids: a block no other prompt has."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, num_blocks: int) -> tuple[int, ...]:
        first, self._next = self._next, self._next + num_blocks
        return tuple(range(first, self._next))


def _session(
    rng: random.Random, ids: _Ids, shape: GeneratedTrace, start_s: float, prefix: tuple[int, ...]
) -> Iterator[TraceRow]:
    """One session's requests: each prompt is the last one, its answer and a new message."""
    context = [*prefix, *ids.take(rng.randint(*shape.first_blocks))]
    at = start_s
    while True:
        output = max(1, round(rng.expovariate(1 / shape.mean_output)))
        # The prompt ends inside its last block: the engine computes the last token itself.
        tokens = (len(context) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
        yield TraceRow(at * 1e3, tokens, output, tuple(context))
        if rng.random() < 1 / shape.mean_turns:
            return
        answer = -(-output // MOONCAKE_BLOCK_TOKENS)
        context.extend(ids.take(answer + rng.randint(*shape.turn_blocks)))
        at += rng.expovariate(1 / shape.think_s)


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """An index in [0, n) drawn with weight 1 / (rank + 1)^s."""
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]
