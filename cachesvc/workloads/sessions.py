"""Routing workloads as token-id sessions: shared-prefix groups, multi-turn chats, trace replay.

Pure and deterministic: the same arguments give the same token ids and arrival times in every
process. A `Session` is one user: it arrives at `arrival_s`, and each turn's prompt is the
session's history (prefix, earlier questions and the answers the model gave) plus the turn's
question, so multi-turn prompts grow and reuse their own past.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for this many tokens


@dataclass(frozen=True)
class Turn:
    question_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    arrival_s: float
    prefix_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    think_s: float = 0.0  # pause between an answer and the next question

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    # Low ids are special tokens in most vocabularies (BOS, EOS, chat markers): avoid them.
    low = min(32, vocab_size // 4)
    return tuple(rng.randrange(low, vocab_size) for _ in range(n))


def _poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` per second; all at 0 when rate <= 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def groups_workload(
    vocab_size: int,
    *,
    num_groups: int = 8,
    prompts_per_group: int = 4,
    system_len: int = 96,
    question_len: int = 16,
    output_len: int = 8,
    rate: float = 2.0,
    seed: int = 0,
) -> list[Session]:
    """SGLang's generated-shared-prefix: `num_groups` system prompts, each shared by
    `prompts_per_group` one-turn requests, arriving interleaved as a Poisson process."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab_size) for _ in range(num_groups)]
    order = [g for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    arrivals = _poisson_arrivals(rng, len(order), rate)
    return [
        Session(t, systems[g], (Turn(_tokens(rng, question_len, vocab_size), output_len),))
        for t, g in zip(arrivals, order, strict=True)
    ]


def multiturn_workload(
    vocab_size: int,
    *,
    num_users: int = 4,
    num_turns: int = 3,
    system_len: int = 48,
    question_len: int = 16,
    output_len: int = 8,
    rate: float = 1.0,
    think_s: float = 0.2,
    seed: int = 0,
) -> list[Session]:
    """production-stack's multi-round QA: users share a system prompt and each keeps a growing
    history; a user's next question follows its previous answer after `think_s`."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab_size)
    arrivals = _poisson_arrivals(rng, num_users, rate)
    return [
        Session(
            t,
            system,
            tuple(
                Turn(_tokens(rng, question_len, vocab_size), output_len) for _ in range(num_turns)
            ),
            think_s,
        )
        for t in arrivals
    ]


def hot_prefix_workload(
    vocab_size: int,
    *,
    prefix_len: int = 1024,
    num_forks: int = 16,
    suffix_len: int = 32,
    output_len: int = 8,
    fork_at_s: float = 2.0,
    rate: float = 4.0,
    seed: int = 0,
) -> list[Session]:
    """One agent's long context forked into many sub-agents (llm-d's P2P benchmark): a parent
    request computes the `prefix_len`-token context at 0; from `fork_at_s` on, `num_forks`
    requests of that context plus a suffix of their own arrive as a Poisson burst of `rate`
    per second, so the worker holding the context faces them all at once."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    parent = Session(0.0, prefix, (Turn(_tokens(rng, suffix_len, vocab_size), output_len),))
    arrivals = _poisson_arrivals(rng, num_forks, rate)
    return [parent] + [
        Session(fork_at_s + t, prefix, (Turn(_tokens(rng, suffix_len, vocab_size), output_len),))
        for t in arrivals
    ]


@dataclass(frozen=True)
class TraceScale:
    """How a Mooncake trace is shrunk to fit a small machine.

    Requests are taken from the `families` most frequent prefix families (requests sharing
    their first hash id), so the sample keeps the trace's prefix sharing; at most `max_requests`
    of them, in time order, re-timed to span `duration_s`. Each hash id becomes `block_tokens`
    tokens, at most `max_blocks` per request; outputs are capped at `max_output`.
    """

    block_tokens: int = 8
    max_blocks: int = 16
    families: int = 6
    max_requests: int = 36
    duration_s: float = 20.0
    max_output: int = 8


def hash_block_tokens(hash_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """The tokens standing for one trace hash id: the same id, the same tokens, everywhere."""
    return _tokens(random.Random(hash_id * 1_000_003 + 17), block_tokens, vocab_size)


@dataclass(frozen=True)
class TraceRow:
    """One request of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one per MOONCAKE_BLOCK_TOKENS tokens; equal ids: shared prefix


def load_mooncake(path: str | Path) -> list[TraceRow]:
    """Rows of a Mooncake JSONL trace; raises ValueError naming the line of a malformed row."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            row = TraceRow(
                float(raw["timestamp"]),
                int(raw["input_length"]),
                int(raw["output_length"]),
                tuple(int(h) for h in raw["hash_ids"]),
            )
            if not row.hash_ids:
                raise ValueError("hash_ids is empty")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a Mooncake trace row: {exc}") from exc
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: the trace is empty")
    return rows


def trace_workload(rows: Sequence[TraceRow], vocab_size: int, scale: TraceScale) -> list[Session]:
    """One-turn sessions replaying a sample of the trace (see `TraceScale`)."""
    families: dict[int, int] = {}
    for row in rows:
        families[row.hash_ids[0]] = families.get(row.hash_ids[0], 0) + 1
    top = set(sorted(families, key=lambda h: (-families[h], h))[: scale.families])
    chosen = [r for r in rows if r.hash_ids[0] in top][: scale.max_requests]
    t0 = chosen[0].timestamp_ms
    span = max(chosen[-1].timestamp_ms - t0, 1e-9)
    sessions = []
    for row in chosen:
        scaled_len = math.ceil(row.input_length * scale.block_tokens / MOONCAKE_BLOCK_TOKENS)
        blocks = row.hash_ids[: scale.max_blocks]
        ids = [t for h in blocks for t in hash_block_tokens(h, scale.block_tokens, vocab_size)]
        ids = ids[: max(1, min(scaled_len, len(ids)))]
        output = max(1, min(row.output_length, scale.max_output))
        arrival = (row.timestamp_ms - t0) / span * scale.duration_s
        sessions.append(Session(arrival, tuple(ids), (Turn((), output),)))
    return sessions
