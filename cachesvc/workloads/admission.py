"""What `cachesvc bench admission` sends and reports, one definition for the live bench and for
its replay in the simulator (`cachesvc simulate --like-bench-admission`): the setups, the
arguments, a prompt of its own per request, and a setup's result row."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.workloads.table import format_table, percentile

NUM_WORKERS = 2
MAX_TOKENS = 4
STREAM_TOKENS = 32  # an answer's tokens with an inter-token target
WARMUPS = 3  # one at a time: the capacity, and what admission learns its scale from
# A burst's requests at most: where the measured capacity is high (a tiny model), the burst is
# cut short at its rate rather than sent at a lower one. Each worker can queue all of them, so
# without admission nothing is refused, however the router spreads them.
MAX_BURST = 768
WITHOUT, WITH, ON_STREAMS = "without admission", "with admission", "with admission on the streams"
SETUPS = (WITHOUT, WITH)


@dataclass(frozen=True)
class AdmissionBenchArgs:
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    json_path: str | None = None
    ttft_ms: float = 3000.0  # the TTFT target, and admission's `admit_ttft_ms`
    overload: float = 2.0  # the burst's arrival rate over the measured capacity
    seconds: float | None = None  # of arrivals (default 20, quick 10)
    prompt_len: int | None = None  # tokens per prompt (default 384, quick 192)
    # The inter-token target (each request's mean gap), and admission's `admit_itl_ms` in a
    # third setup; None: TTFT alone, four-token answers.
    itl_ms: float | None = None
    max_tokens: int | None = None  # an answer's tokens (default 4; with itl_ms, 32)

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.overload <= 0:
            raise ValueError("--ttft-ms and --overload must be positive")
        if (self.itl_ms is not None and self.itl_ms <= 0) or (
            self.max_tokens is not None and self.max_tokens < 1
        ):
            raise ValueError("--itl-ms must be positive and --max-tokens >= 1")
        if (self.seconds is not None and self.seconds <= 0) or (
            self.prompt_len is not None and self.prompt_len < 2
        ):
            raise ValueError("--seconds must be positive and --prompt-len >= 2")

    @property
    def duration_s(self) -> float:
        return self.seconds or (10.0 if self.quick else 20.0)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len or (192 if self.quick else 384)

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens or (MAX_TOKENS if self.itl_ms is None else STREAM_TOKENS)

    def burst_size(self, rate: float) -> int:
        """The burst's requests at `rate` requests/s: `duration_s` of arrivals, at most
        MAX_BURST."""
        return min(MAX_BURST, max(1, round(self.duration_s * rate)))

    @property
    def setups(self) -> tuple[str, ...]:
        return SETUPS if self.itl_ms is None else (*SETUPS, ON_STREAMS)

    def targets(self, setup: str) -> tuple[float | None, float | None]:
        """A setup's admission targets (ms): `admit_ttft_ms`, `admit_itl_ms` (None: off)."""
        ttft = None if setup == WITHOUT else self.ttft_ms
        return ttft, self.itl_ms if setup == ON_STREAMS else None


@dataclass
class SetupResult:
    """One setup's burst, as its client saw it."""

    setup: str
    offered_rps: float
    ttft_target_ms: float
    ttft_s: list[float] = field(default_factory=list)  # the served requests'
    refused: int = 0
    span_s: float = 0.0  # from the first arrival to the last answer (or refusal)
    itl_target_ms: float | None = None  # None: goodput counts the TTFT alone
    itl_s: list[float] = field(default_factory=list)  # the served requests' mean gaps

    @property
    def num_requests(self) -> int:
        return len(self.ttft_s) + self.refused

    @property
    def within(self) -> int:
        """Served requests within the targets."""
        itl = self.itl_s or [0.0] * len(self.ttft_s)
        ttft_ok = [t * 1e3 <= self.ttft_target_ms for t in self.ttft_s]
        itl_ok = [self.itl_target_ms is None or g * 1e3 <= self.itl_target_ms for g in itl]
        return sum(a and b for a, b in zip(ttft_ok, itl_ok, strict=True))

    @property
    def goodput_rps(self) -> float:
        return self.within / self.span_s if self.span_s > 0 else 0.0

    def row(self, baseline_rps: float | None) -> list[Any]:
        ratio = f"{self.goodput_rps / baseline_rps:.2f}x" if baseline_rps else "-"
        return [
            self.setup,
            self.offered_rps,
            self.num_requests,
            self.refused,
            self.within,
            percentile(self.ttft_s, 50) * 1e3,
            percentile(self.ttft_s, 99) * 1e3,
            percentile(self.itl_s, 50) * 1e3 if self.itl_s else "-",
            percentile(self.itl_s, 99) * 1e3 if self.itl_s else "-",
            self.goodput_rps,
            ratio,
        ]


def prompt(index: int, num_tokens: int, vocab: int) -> list[int]:
    """A prompt of its own (nothing shared with any other index)."""
    rng = random.Random(f"bench-admission-{index}")
    return [rng.randrange(3, vocab - 1) for _ in range(num_tokens)]


def mean_gap_s(times: Sequence[float]) -> float:
    """The mean gap between consecutive token times (0.0 for one token)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


def format_results(results: Sequence[SetupResult]) -> str:
    headers = ["setup", "offered req/s", "requests", "refused", "within targets"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "mean ITL p50 ms", "mean ITL p99 ms"]
    headers += ["goodput req/s", "vs without"]
    baseline = results[0].goodput_rps if results else None
    rows = [r.row(None if i == 0 else baseline) for i, r in enumerate(results)]
    target = results[0].ttft_target_ms if results else 0.0
    itl = results[0].itl_target_ms if results else None
    targets = f"TTFT target {target:g} ms (admission's admit_ttft_ms)"
    if itl is not None:
        targets += f", mean ITL target {itl:g} ms (admit_itl_ms, in the last setup)"
    return format_table(headers, rows) + (
        f"\n\n{targets}; goodput: requests served within the targets per second, from the "
        "first arrival to the last answer"
    )
