"""`cachesvc bench serve --url URL`: one workload against any OpenAI-compatible server.

A load generator of our own, so ours and another server (vLLM) are measured by the same code:
`--concurrency` streams, each sending its next request as soon as its last one ended (a closed
loop, as vLLM's `benchmark_serving --max-concurrency` and SGLang's `bench_serving`), until
`--num-requests` were sent. Every request is greedy with `ignore_eos`, so every server generates
the same number of tokens, and each answer's text is kept: `--compare FILE` counts the prompts
on which this run's text equals an earlier run's (the same seed and workload: the same prompts).
One warm-up request first (a prompt of another seed, so it caches nothing the run reuses).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cachesvc.bench.serve_client import APIS, Answer, OpenAIServer
from cachesvc.bench.serve_workload import WORKLOADS, ServePrompt, serve_prompts, warmup_prompt
from cachesvc.workloads.table import format_table, percentile, write_json


@dataclass(frozen=True)
class ServeBenchArgs:
    """The flags of `cachesvc bench serve`; a value out of range raises ValueError naming it."""

    url: str
    workload: str = "shared-prefix"
    concurrency: int = 4
    num_requests: int = 32
    max_tokens: int = 32
    seed: int = 0
    model: str | None = None  # default: the first `GET /v1/models` lists
    api: str = "chat"
    system_words: int = 1000
    question_words: int | None = None  # default: the workload's
    warmup: int = 1
    api_key: str | None = None
    json_path: str | None = None
    compare: str | None = None
    label: str | None = None  # a name for the server in the output (e.g. "vllm")

    def __post_init__(self) -> None:
        checks = (
            (self.url.startswith(("http://", "https://")), "--url must be http(s)://host:port"),
            (self.workload in WORKLOADS, f"--workload must be one of {', '.join(WORKLOADS)}"),
            (self.api in APIS, f"--api must be one of {', '.join(APIS)}"),
            (self.concurrency >= 1, "--concurrency must be at least 1"),
            (self.num_requests >= 1, "--num-requests must be at least 1"),
            (self.max_tokens >= 1, "--max-tokens must be at least 1"),
            (self.system_words >= 0, "--system-words must be 0 or more"),
            (self.question_words is None or self.question_words >= 1, "--question-words >= 1"),
            (self.warmup >= 0, "--warmup must be 0 or more"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class ServeSummary:
    """A run's figures: milliseconds, per second over the run's wall time (the first request
    sent to the last answer), token counts as the server's usage reported them."""

    num_requests: int
    num_ok: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    output_tokens: int
    prompt_tokens_mean: float
    cached_tokens: int | None  # summed over requests; None when the server does not report it
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float  # gaps between chunks with text, all requests pooled
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float  # per request (last - first token) / (tokens - 1), averaged
    e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float


def summarize(answers: list[Answer], duration_s: float) -> ServeSummary:
    """The figures of a run's answers (only the successful ones are timed)."""
    ok = [a for a in answers if a.ok]
    ttft = [a.ttft_s * 1e3 for a in ok]
    gaps = [g * 1e3 for a in ok for g in a.gaps_s]
    tpot = [t * 1e3 for a in ok if (t := a.tpot_s) is not None]
    e2e = [a.e2e_s * 1e3 for a in ok]
    cached = [a.cached_tokens for a in ok if a.cached_tokens is not None]
    output = sum(a.completion_tokens for a in ok)
    return ServeSummary(
        num_requests=len(answers),
        num_ok=len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s,
        output_tokens_per_s=output / duration_s,
        output_tokens=output,
        prompt_tokens_mean=statistics.fmean(a.prompt_tokens for a in ok) if ok else 0.0,
        cached_tokens=sum(cached) if cached else None,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        itl_mean_ms=statistics.fmean(gaps) if gaps else 0.0,
        itl_p50_ms=percentile(gaps, 50),
        itl_p99_ms=percentile(gaps, 99),
        tpot_mean_ms=statistics.fmean(tpot) if tpot else 0.0,
        e2e_mean_ms=statistics.fmean(e2e) if e2e else 0.0,
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
    )


def run_requests(
    server: OpenAIServer, prompts: list[ServePrompt], concurrency: int
) -> tuple[list[Answer], float]:
    """Send every prompt, `concurrency` at a time (a stream sends its next when its last one
    ended); the answers in prompt order and the wall time from first send to last answer."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda ip: server.send(ip[1], ip[0], start), enumerate(prompts)))
    return answers, time.perf_counter() - start


_PROMPT_FIELDS = ("workload", "seed", "system_words", "question_words", "api", "max_tokens")


def load_comparable(args: ServeBenchArgs) -> dict[str, Any] | None:
    """The run `--compare` names (its `--json`), None without the flag; raises ValueError when
    that run sent other prompts or asked for other answers."""
    if not args.compare:
        return None
    other: dict[str, Any] = json.loads(Path(args.compare).read_text())
    mine = {k: getattr(args, k) for k in _PROMPT_FIELDS}
    theirs = {k: other["args"].get(k) for k in _PROMPT_FIELDS}
    if mine != theirs:
        raise ValueError(f"--compare: {args.compare} sent other prompts: {theirs}, here {mine}")
    return other


def compare_texts(answers: list[Answer], other: dict[str, Any], path: str) -> dict[str, Any]:
    """How many of this run's prompts got the same text as in the `other` run (read from
    `path`), of those both answered, and which differ (a prompt either failed included)."""
    theirs = {a["index"]: a for a in other["answers"]}
    mine = {a.index: a for a in answers}
    common = sorted(set(theirs) & set(mine))
    both = [i for i in common if mine[i].ok and theirs[i].get("ok", True)]
    same = {i for i in both if mine[i].text == theirs[i]["text"]}
    return {
        "other": path,
        "other_label": other.get("label"),
        "compared": len(common),
        "both_answered": len(both),
        "same_text": len(same),
        "differ": [i for i in common if i not in same],
    }


def run_serve_bench(args: ServeBenchArgs) -> int:
    """Blocking entry point: run the workload, print the figures (and the comparison), write
    the JSON; returns 0, or 1 when a request failed."""
    server = OpenAIServer(args.url, args.api, args.model or "", args.max_tokens, args.api_key)
    if not args.model:
        server = OpenAIServer(
            args.url, args.api, server.first_model(), args.max_tokens, args.api_key
        )
    other = load_comparable(args)
    prompts = serve_prompts(
        args.workload, args.num_requests, args.seed, args.system_words, args.question_words
    )
    for i in range(args.warmup):
        warm = server.send(warmup_prompt(args.seed + i, args.system_words), -1, time.perf_counter())
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
    answers, duration_s = run_requests(server, prompts, args.concurrency)
    summary = summarize(answers, duration_s)
    comparison = compare_texts(answers, other, args.compare) if other and args.compare else None
    print(report(args, server.model, summary, comparison))
    for a in answers:
        if not a.ok:
            print(f"request {a.index} failed: {a.error}")
    payload = {
        "label": args.label,
        "args": asdict(args) | {"api_key": None},
        "model": server.model,
        "summary": asdict(summary),
        "comparison": comparison,
        "answers": [asdict(a) for a in answers],
    }
    write_json(args.json_path, payload)
    return 0 if summary.num_ok == summary.num_requests else 1


def report(
    args: ServeBenchArgs, model: str, s: ServeSummary, comparison: dict[str, Any] | None
) -> str:
    """The printed result: one line of setup, a table of figures, the comparison's line."""
    head = (
        f"{args.label or args.url} · {model} · {args.workload}, {args.num_requests} requests, "
        f"{args.concurrency} streams, {args.max_tokens} greedy tokens each, /v1/"
        f"{'chat/completions' if args.api == 'chat' else 'completions'} streamed"
    )
    cached = "-" if s.cached_tokens is None else s.cached_tokens
    rows: list[list[Any]] = [
        ["answered", f"{s.num_ok}/{s.num_requests}"],
        ["requests/s", s.requests_per_s],
        ["output tokens/s", s.output_tokens_per_s],
        ["prompt tokens (mean) / cached (sum)", f"{s.prompt_tokens_mean:.0f} / {cached}"],
        ["TTFT p50 / p99 ms", f"{s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f}"],
        [
            "ITL mean / p50 / p99 ms",
            f"{s.itl_mean_ms:.1f} / {s.itl_p50_ms:.1f} / {s.itl_p99_ms:.1f}",
        ],
        ["TPOT mean ms", s.tpot_mean_ms],
        [
            "E2E mean / p50 / p99 ms",
            f"{s.e2e_mean_ms:.0f} / {s.e2e_p50_ms:.0f} / {s.e2e_p99_ms:.0f}",
        ],
        ["wall s", s.duration_s],
    ]
    lines = [head, format_table(["figure", "value"], rows)]
    if comparison is not None:
        lines.append(
            f"same text as {comparison['other_label'] or comparison['other']} on "
            f"{comparison['same_text']} of {comparison['both_answered']} prompts both answered "
            f"({comparison['compared']} sent)"
        )
    return "\n".join(lines)
