"""The record of one GPU check run (`gpu_check`): its phases' results, time caps, and the
one-page report (DIR/report.{json,md}) that docs/benchmarks.md can paste."""

from __future__ import annotations

import json
import signal
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cachesvc.bench import decode_cascade, prefill_schemes
from cachesvc.bench.gpu_check import correctness as correctness

T = TypeVar("T")


# ---- the run and its report --------------------------------------------------------------------


class PhaseTimeout(Exception):
    """A phase ran past its cap."""


@contextmanager
def time_cap(seconds: int) -> Iterator[None]:
    """Raise PhaseTimeout in the main thread after `seconds` (checked between Python calls)."""

    def expire(signum: int, frame: object) -> None:
        raise PhaseTimeout(f"over its {seconds} s cap")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Run:
    """The options of this run and everything recorded so far (saved after each phase)."""

    out: Path
    backend: str
    device: str
    quick: bool
    model: str | None
    results: dict[str, Any]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")

    def check(self, name: str, ok: bool, error: str = "", **numbers: float) -> None:
        entry: dict[str, Any] = {"name": name, "ok": bool(ok), **numbers}
        if error:
            entry["error"] = error
        self.results.setdefault("checks", []).append(entry)
        detail = " ".join(f"{k}={v:.3g}" for k, v in numbers.items())
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {detail} {error}", flush=True)

    def record(self, name: str, c: correctness.Comparison) -> None:
        """Record a comparison with float32 and the torch backend's own error as a check."""
        self.check(
            name,
            c.ok,
            max_out_err=c.max_out_err,
            torch_out_err=c.ref_out_err,
            ratio=c.ratio,
            max_lse_err=c.max_lse_err,
        )

    def guarded(self, name: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None after recording its exception as a failed check (caps still apply)."""
        try:
            return fn()
        except PhaseTimeout:
            raise
        except Exception as err:
            traceback.print_exc()
            self.check(name, False, error=f"{type(err).__name__}: {err}"[:400])
            return None


# ---- the report --------------------------------------------------------------------------------


def summary(run: Run) -> dict[str, Any]:
    """report.json: the outcome, versions, phases, worst comparisons and every timed cell."""
    results = run.results
    cfg = prefill_schemes.bench_config(run.backend, quick=run.quick)
    checks = results.get("checks", [])
    engine = [c for c in checks if c["name"].startswith("engine")]
    kernels = [c for c in checks if "ratio" in c and c not in engine]
    worst = max(kernels, key=lambda c: c["ratio"], default=None)
    timing = results.get("timing", {})
    return {
        "ok": results.get("ok", False),
        "versions": results.get("versions", {}),
        "phases": results.get("phases", {}),
        "criteria": {
            "error_ratio": correctness.ERROR_RATIO,
            "lse_atol": {str(k)[6:]: v for k, v in correctness.LSE_ATOL.items()},
        },
        "kernel_checks": len(kernels),
        "worst_kernel_check": worst,
        "failed": [c for c in checks if not c["ok"]],
        "engine": engine,
        "engine_generate": results.get("engine_generate", {}),
        "bench": {
            "dtype": str(cfg.dtype)[6:],
            "heads": f"{cfg.num_qo_heads}/{cfg.num_kv_heads}",
            "head_dim": cfg.head_dim,
            "page_size": cfg.page_size,
            "warmup": cfg.warmup,
            "iters": str(cfg.min_iters)
            if cfg.min_iters == cfg.max_iters
            else f"{cfg.min_iters}-{cfg.max_iters}",
            "grid": "quick" if run.quick else "seed",
        },
        "prefill": timing.get("prefill", []),
        "decode": timing.get("decode", []),
    }


def report_markdown(report: dict[str, Any]) -> str:
    """One page for docs/benchmarks.md: outcome, criteria met, and both timing tables."""
    versions = report["versions"]
    phases = report["phases"]
    took = ", ".join(f"{k} {p.get('seconds', 0):.0f} s" for k, p in phases.items())
    outcome = "PASS" if report["ok"] else "FAIL"
    lines = [
        f"# FlashInfer backend on {versions.get('gpu', 'no GPU')}",
        "",
        f"flashinfer {versions.get('flashinfer', '-')}, torch {versions.get('torch')} (CUDA "
        f"{versions.get('torch_cuda')}), Python {versions.get('python')}: **{outcome}** ({took}).",
        "",
    ]
    worst = report["worst_kernel_check"]
    if worst is not None:
        lse = ", ".join(
            f"{atol:g} ({dtype})" for dtype, atol in report["criteria"]["lse_atol"].items()
        )
        lines.append(
            f"- Kernels: {report['kernel_checks']} checks (every scheme x "
            f"{len(correctness.CASES)} cases x fp16/hd128 and bf16/hd64, merge_state) against "
            f"float32; output error at most {report['criteria']['error_ratio']:g}x the torch "
            f"backend's in the same dtype, worst {worst['ratio']:.2f}x (`{worst['name']}`); "
            f"base-2 LSE within {lse}."
        )
    for check in report["engine"]:
        numbers = ", ".join(
            f"{k} {v:.3g}" for k, v in check.items() if k not in ("name", "ok", "error")
        )
        lines.append(f"- {check['name']}: {'ok' if check['ok'] else 'FAIL'} ({numbers}).")
    lines += [f"- phase {k} FAILED: {p['error']}" for k, p in phases.items() if not p["ok"]]
    lines += [f"- FAIL `{c['name']}` {c.get('error', '')}" for c in report["failed"]]
    b = report["bench"]
    setup = (
        f"heads {b['heads']}, head_dim {b['head_dim']}, page {b['page_size']}, {b['dtype']}; "
        f"ms = median of {b['iters']} timed runs after {b['warmup']} warm-up"
    )
    grid = "the seed's P x S x M grid" if b["grid"] == "seed" else "one cell, --quick"
    if report["prefill"]:
        lines += [
            "",
            f"## Shared-prefix prefill schemes ({grid})",
            "",
            f"{setup}; (x) = speedup over naive; auto = `choose_scheme`'s pick, within 10% of "
            "the fastest or not.",
            "",
            prefill_schemes.table(report["prefill"]),
        ]
    if report["decode"]:
        lines += [
            "",
            "## Cascade decode",
            "",
            f"N requests sharing a P-token prefix, {decode_cascade.OWN_LEN} own tokens each, one "
            f"decode step; {setup}; ideal = ratio of KV tokens read.",
            "",
            decode_cascade.table(report["decode"]),
        ]
    return "\n".join(lines) + "\n"


def write_report(run: Run) -> None:
    report = summary(run)
    (run.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (run.out / "report.md").write_text(report_markdown(report))
