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
from dataclasses import dataclass, field
from typing import Any

from cachesvc.workloads.table import format_table, percentile

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


@dataclass(frozen=True)
class PDBenchArgs:
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    json_path: str | None = None
    pd_mode: str = "auto"
    # The router's target for a stream's gap between two tokens (`pd_itl_slo_ms`; None: none).
    itl_slo_ms: float | None = None
    # The prefill worker's chunk (None: the step budget), and whether decode workers pull while
    # the prefill runs (`RouterConfig.pd_prefetch`).
    prefill_chunk_tokens: int | None = 512
    prefetch: bool = True

    @property
    def shape(self) -> PDShape:
        return PDShape(self.quick)


@dataclass
class PhaseResult:
    """What a client saw in one phase of one setup."""

    setup: str
    phase: str  # "decodes alone" | "with long prompts"
    gaps_s: list[float] = field(default_factory=list)  # the decodes' inter-token gaps
    ttft_s: list[float] = field(default_factory=list)  # the long prompts' TTFTs
    # The long prompts' TTFTs as their workers measured them (from the engine's arrival).
    worker_ttft_s: list[float] = field(default_factory=list)
    # A handed-off long prompt's first two tokens apart: the hand-off as the client sees it (the
    # decode worker pulls the KV, lands it, computes the tail and its first token).
    handoff_s: list[float] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)  # the router's reason for each long prompt
    disaggregated: int = 0  # long prompts handed to a prefill worker
    kv_moved_tokens: int = 0
    # Landed on decode workers by pulls made while the prefill ran, and the chunks prefill
    # workers sent before a prompt was all computed (the workers' counters: every request of
    # the phase handed off, a stream too when it is).
    prefetched_tokens: int = 0
    early_chunks: int = 0

    def row(self, baseline_p99: float | None) -> list[Any]:
        p50, p99 = percentile(self.gaps_s, 50), percentile(self.gaps_s, 99)
        ratio = "-" if not baseline_p99 else f"{p99 / baseline_p99:.2f}x"
        ttft = None
        if self.ttft_s:
            ttft = (percentile(self.ttft_s, 50) * 1e3, percentile(self.ttft_s, 99) * 1e3)
        handoff = "-"
        if self.handoff_s:
            low, high = percentile(self.handoff_s, 50), percentile(self.handoff_s, 99)
            handoff = f"{low * 1e3:.0f} / {high * 1e3:.0f}"
        return [
            self.setup,
            self.phase,
            f"{p50 * 1e3:.1f}",
            f"{p99 * 1e3:.1f}",
            ratio,
            "-" if ttft is None else f"{ttft[0]:.0f}",
            "-" if ttft is None else f"{ttft[1]:.0f}",
            f"{self.disaggregated}/{len(self.ttft_s)}" if self.ttft_s else "-",
            handoff,
            f"{self.kv_moved_tokens} / {self.prefetched_tokens}" if self.disaggregated else "-",
        ]


def format_results(results: list[PhaseResult]) -> str:
    headers = [
        "setup",
        "phase",
        "gap p50 ms",
        "gap p99 ms",
        "p99 vs alone",
        "long TTFT p50 ms",
        "long TTFT p99 ms",
        "handed off",
        "hand-off p50 / p99 ms",
        "KV moved / before 1st token",
    ]
    rows = []
    baseline: dict[str, float] = {}
    for r in results:
        if r.phase == ALONE:
            baseline[r.setup] = percentile(r.gaps_s, 99)
        rows.append(r.row(None if r.phase == ALONE else baseline.get(r.setup)))
    return format_table(headers, rows)
