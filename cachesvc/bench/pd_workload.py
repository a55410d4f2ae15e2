"""The requests `cachesvc bench pd` sends, one list for the live bench and for its replay in the
simulator (`cachesvc simulate --like-bench-pd`), so both serve exactly the same work.

Each setup (`SETUPS`: two mixed workers, or one prefill and one decode worker) first serves one
short request to warm the path (`warmup_request`), then runs two phases one after the other,
each once the previous one is done. In the first, `streams` greedy decodes (a 48-token prompt,
`decode_tokens` tokens each) start together; in the second, the same number of decodes start
together and, from `2 * interval_s` on, `long_prompts` long prompts (`long_tokens` tokens, a
short answer) arrive one every `interval_s`. Prompts are random token ids drawn from a seed per
phase: no request shares a block with another.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Setup name -> (prefill workers, decode workers) of the two; the rest are mixed.
SETUPS: dict[str, tuple[int, int]] = {"2 mixed": (0, 0), "1 prefill + 1 decode": (1, 1)}
NUM_WORKERS = 2
ALONE, WITH_PROMPTS = "decodes alone", "with long prompts"
PHASE_SEEDS = {ALONE: 1, WITH_PROMPTS: 2}
DECODE_PROMPT_LEN = 48
LONG_OUTPUT_LEN = 8
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 64, 4
# Every worker computes one prompt of this size before the phases, sent to it directly: a
# worker's prefill cost is calibrated at its start on short passes (while the other worker
# starts too); a real prompt corrects it before the router's first decision relies on it.
WORKER_WARMUP_PROMPT_LEN = 512
BLOCK_SIZE = 16


@dataclass(frozen=True)
class PDShape:
    """The bench's sizes: `quick` is a short run (2 streams of 64 tokens, 2 prompts of 1K)."""

    quick: bool = False

    @property
    def streams(self) -> int:
        return 2 if self.quick else 4

    @property
    def decode_tokens(self) -> int:
        return 64 if self.quick else 160

    @property
    def long_prompts(self) -> int:
        return 2 if self.quick else 4

    @property
    def long_tokens(self) -> int:
        return 1024 if self.quick else 2048

    @property
    def interval_s(self) -> float:
        return 1.5

    @property
    def num_blocks(self) -> int:
        """KV blocks per worker: every decode and two long prompts at once, with room."""
        tokens = self.streams * (DECODE_PROMPT_LEN + self.decode_tokens) + 2 * self.long_tokens
        return 2 * (tokens // BLOCK_SIZE + 64)


@dataclass(frozen=True)
class PDRequest:
    """One request of a phase: sent `offset_s` after the phase starts."""

    offset_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    long: bool  # a long prompt (its TTFT is reported), else a decode stream (its gaps are)


def warmup_request(vocab_size: int) -> PDRequest:
    """The request served before the phases (first calls are slow), not reported."""
    rng = random.Random(0)
    return PDRequest(0.0, _ids(rng, WARMUP_PROMPT_LEN, vocab_size), WARMUP_OUTPUT_LEN, False)


def worker_warmup_request(vocab_size: int) -> PDRequest:
    """The prompt every worker computes before the phases (sent to it, not routed)."""
    rng = random.Random(3)
    return PDRequest(0.0, _ids(rng, WORKER_WARMUP_PROMPT_LEN, vocab_size), 1, False)


def phase_requests(shape: PDShape, phase: str, vocab_size: int) -> list[PDRequest]:
    """The requests of `phase` (`ALONE` or `WITH_PROMPTS`), in the order they are sent."""
    rng = random.Random(PHASE_SEEDS[phase])
    requests = [
        PDRequest(0.0, _ids(rng, DECODE_PROMPT_LEN, vocab_size), shape.decode_tokens, False)
        for _ in range(shape.streams)
    ]
    if phase == WITH_PROMPTS:
        first = 2 * shape.interval_s  # the decodes are under way
        requests += [
            PDRequest(
                first + i * shape.interval_s,
                _ids(rng, shape.long_tokens, vocab_size),
                LONG_OUTPUT_LEN,
                True,
            )
            for i in range(shape.long_prompts)
        ]
    return requests


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab_size - 1) for _ in range(n))
