"""`python -m cachesvc.bench.gpu_check --out DIR`: check and time the FlashInfer backend on one GPU.

The prepared device script of research notes §11, run by `make gpu-check` (docs/gpu.md). Each
phase has its own time cap, and DIR/results.json is rewritten as soon as a phase ends:

1. build: the JIT modules the backend loads, in one ninja run (FA2 prefill and CUDA-core decode
   for fp16 / head_dim 128, the benchmarks, and bf16 / head_dim 64, SmolLM2; cascade merge).
2. correctness: every scheme on the GPU against the torch backend in float32 on CPU copies
   (outputs, base-2 LSE), cascade decode == batch decode, multi-item == custom mask, merge_state;
   the cases and comparisons are `gpu_check_correctness`.
3. engine: a SmolLM2-135M-shaped bf16 model (random weights unless `--model`): teacher-forced
   logits against the torch backend in bf16 and float32, and greedy generation via `Engine`.
4. timing: the two kernel benchmarks of `cachesvc/bench` on the seed's grids, cell by cell.

`--backend torch --device cpu` runs phases 2-4 against the torch backend itself: a dry run of
this script on any machine. Exit status 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from itertools import product
from pathlib import Path
from typing import Any, TypeVar

import torch

from cachesvc.bench import decode_cascade, prefill_schemes
from cachesvc.bench import gpu_check_correctness as correctness
from workers.attention.layout import build_layout
from workers.attention.schemes import make_scheme_backend

PHASES = ("build", "correctness", "engine", "timing")
CAPS_S = {"build": 240, "correctness": 90, "engine": 90, "timing": 210}
TOTAL_S = 420  # the whole script stays under 7 minutes (8 with pytest after it)
KERNELS = ((torch.float16, 128), (torch.bfloat16, 64))  # (dtype, head_dim) of every module built

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
        """Record a comparison with its reference as a check."""
        self.check(name, c.ok, max_out_err=c.max_out_err, max_lse_err=c.max_lse_err)

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


# ---- phase 1: build ----------------------------------------------------------------------------


def jit_specs() -> list[Any]:
    """The JitSpecs of the modules the backend loads, as the 0.7.x wrappers name them."""
    from flashinfer.jit.attention import modules
    from flashinfer.jit.cascade import gen_cascade_module

    # The FA2 wrappers load the "equal K/V strides" primary module (prefill.py,
    # get_batch_prefill_module); other versions build the public one.
    prefill = getattr(
        modules, "_gen_batch_prefill_primary_module", modules.gen_batch_prefill_module
    )
    specs = [gen_cascade_module()]
    for dtype, head_dim in KERNELS:
        common = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)
        specs.append(prefill("fa2", *common, False))
        specs.append(modules.gen_batch_decode_module(*common))
    return specs


def phase_build(run: Run) -> None:
    import flashinfer
    from flashinfer.jit.core import build_jit_specs

    specs = jit_specs()
    run.results["modules"] = [spec.name for spec in specs]
    start = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    run.results["build_s"] = time.perf_counter() - start
    run.results["versions"]["flashinfer"] = flashinfer.__version__


# ---- phase 2: correctness ----------------------------------------------------------------------


def phase_correctness(run: Run) -> None:
    """Every scheme of every case against the torch backend, then cross-checks and merge_state."""
    reference = make_scheme_backend("torch")
    for shapes in correctness.CHECK_SHAPES:
        backend = make_scheme_backend(run.backend)
        tag = f"{str(shapes.dtype)[6:]}/hd{shapes.head_dim}"
        for p, s, m in correctness.CASES:
            case = correctness.make_check_case(p, s, m, shapes, run.device)
            q_ref, cache_ref = case.q.float().cpu(), case.kv_cache.float().cpu()
            got: dict[str, Any] = {}
            label = f"{tag} P={p} S={s} M={m}"
            for name, step in correctness.scheme_steps(case).items():
                run_step = partial(
                    correctness.attention, backend, case.q, case.kv_cache, step, case
                )
                got[name] = run.guarded(f"{label} {name}", run_step)
                want = correctness.attention(reference, q_ref, cache_ref, step, case)
                if got[name] is not None:
                    run.record(f"{label} {name}", correctness.compare(got[name], want))
            for a, b in (("cascade_decode", "decode"), ("multi_item", "custom_mask")):
                if got[a] is not None and got[b] is not None:
                    run.record(f"{label} {a}=={b}", correctness.compare(got[a], got[b]))
        merge = partial(correctness.compare_merge_state, shapes, run.backend, run.device)
        if (merged := run.guarded(f"{tag} merge_state", merge)) is not None:
            run.record(f"{tag} merge_state", merged)


# ---- phase 3: engine ---------------------------------------------------------------------------


def load_models(run: Run) -> dict[torch.dtype, Any]:
    """The model in bf16 and float32: `--model`, else SmolLM2-135M's shapes with random weights."""
    from workers.model.config import ModelConfig
    from workers.model.llama import LlamaModel
    from workers.model.loader import LoadedModel, load_model, model_fingerprint

    dtypes = (torch.bfloat16, torch.float32)
    if run.model:
        return {dt: load_model(run.model, dtype=dt, device=run.device) for dt in dtypes}
    config = ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    shapes = LlamaModel(config).state_dict()  # meta tensors: names and shapes only
    weights = {
        k: torch.ones(t.shape) if k.endswith("norm") else torch.randn(t.shape, generator=gen) * 0.05
        for k, t in shapes.items()
    }
    # An empty folder as the model's path: the engine then finds no tokenizer and takes ids.
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    loaded = {}
    for dt in dtypes:
        model = LlamaModel(config, dtype=dt, device=run.device)
        state = {k: w.to(run.device, dt) for k, w in weights.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.eval()
        fingerprint = model_fingerprint(config, dt, b"random")
        loaded[dt] = LoadedModel(model=model, config=config, fingerprint=fingerprint, path=folder)
    return loaded


PROMPT_LENS = (40, 64, 100, 17)


def teacher_forced_logits(run: Run, loaded: Any, backend_name: str) -> torch.Tensor:
    """Logits of every prompt row (one prefill step), then of one decode step per prompt."""
    model, ps = loaded.model, 16
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, loaded.config.vocab_size, (sum(PROMPT_LENS),), generator=gen)
    pages = [-(-(n + 1) // ps) for n in PROMPT_LENS]
    tables = [list(range(sum(pages[:b]), sum(pages[: b + 1]))) for b in range(len(pages))]
    caches = model.allocate_kv_cache(sum(pages), ps)
    backend = make_scheme_backend(backend_name)
    prefill = list(PROMPT_LENS)
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENS])
    decode = ([1] * len(prefill), [n + 1 for n in prefill], prompt[:4], torch.tensor(prefill))
    steps = [(prefill, prefill, prompt, positions), decode]
    logits = []
    for qo_lens, kv_lens, tokens, positions in steps:
        layout = build_layout(qo_lens, kv_lens, tables, ps, device=run.device)
        backend.plan(layout)
        rows = torch.arange(len(tokens), device=run.device)
        ids, pos = tokens.to(run.device), positions.to(run.device)
        logits.append(model(ids, pos, caches, layout, backend, rows).float().cpu())
    return torch.cat(logits)


def generate(run: Run, loaded: Any, backend_name: str) -> list[tuple[int, ...]]:
    """Greedy tokens of four prompts, three sharing a 64-token prefix, through the engine."""
    from cachesvc.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    config = EngineConfig(
        dtype="bfloat16", device=run.device, num_blocks=256, attention_backend=backend_name
    )
    engine = Engine(config, loaded=loaded)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, loaded.config.vocab_size, (64,), generator=gen).tolist()
    suffixes = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 9, 30)]
    prompts = [prefix + t for t in suffixes] + [suffixes[2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def phase_engine(run: Run) -> None:
    models = load_models(run)
    bf16, fp32 = models[torch.bfloat16], models[torch.float32]
    ref32 = teacher_forced_logits(run, fp32, "torch")
    ref16 = teacher_forced_logits(run, bf16, "torch")
    got = teacher_forced_logits(run, bf16, run.backend)
    err_ref, err = float((ref16 - ref32).abs().max()), float((got - ref32).abs().max())
    # bf16 matmuls dominate the error; a wrong mask or page shows as several times more.
    ok = err <= max(3 * err_ref, 0.05 * float(ref32.std()))
    run.check("engine logits vs float32", ok, max_err=err, torch_bf16_max_err=err_ref)
    top1 = (got.argmax(-1) == ref16.argmax(-1)).float().mean()
    run.results["engine_top1_agreement_vs_torch_bf16"] = float(top1)
    tokens = run.guarded("engine generate", partial(generate, run, bf16, run.backend))
    ref_tokens = generate(run, bf16, "torch")
    if tokens is None:
        return
    pairs = [
        (a, b) for x, y in zip(tokens, ref_tokens, strict=True) for a, b in zip(x, y, strict=True)
    ]
    match = sum(a == b for a, b in pairs) / max(1, len(pairs))
    run.results["engine_generate"] = {"tokens": tokens, "torch_bf16_tokens": ref_tokens}
    # Random weights leave near-ties that bf16 noise can flip: a share of tokens, not all.
    run.check("engine greedy tokens vs torch bf16", match >= 0.75, token_match=match)


# ---- phase 4: timing ---------------------------------------------------------------------------


def phase_timing(run: Run) -> None:
    """Both benchmarks cell by cell, so a cap keeps the cells already timed."""
    cfg = prefill_schemes.bench_config(run.backend, quick=run.quick)
    cells: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    run.results["timing"] = cells
    p_grid = ((96,), (4,), (2,)) if run.quick else prefill_schemes.GPU_GRID
    d_grid = ((1024,), (8,)) if run.quick else decode_cascade.GPU_GRID
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("prefill", partial(prefill_schemes.bench_cell, p, s, m, cfg))
        for p, s, m in product(*p_grid)
    ]
    jobs += [("decode", partial(decode_cascade.bench_cell, p, n, cfg)) for p, n in product(*d_grid)]
    for i, (kind, job) in enumerate(jobs):
        # A cell whose schemes disagree with naive raises AssertionError: recorded, not timed.
        cell = run.guarded(f"timing {kind} cell {i}", job)
        if cell is None:
            continue
        cells[kind].append(cell)
        print(f"  {kind} P={cell['P']} S={cell['S']} M={cell['M']}: {cell['ms']}", flush=True)
        (run.out / f"{kind}_schemes.json").write_text(json.dumps(cells[kind], indent=2) + "\n")


# ---- driver ------------------------------------------------------------------------------------


def run_phases(run: Run, phases: Sequence[str]) -> bool:
    """Run `phases` in order under their caps; True when all ran and every check passed."""
    start = time.perf_counter()
    done = run.results.setdefault("phases", {})
    actions = {"build": phase_build, "correctness": phase_correctness}
    actions.update({"engine": phase_engine, "timing": phase_timing})
    for phase in phases:
        left = int(TOTAL_S - (time.perf_counter() - start))
        if left < 10:
            done[phase] = {"ok": False, "error": "no time left"}
            continue
        print(
            f"[{time.strftime('%H:%M:%S')}] {phase} (cap {min(CAPS_S[phase], left)} s)", flush=True
        )
        t0 = time.perf_counter()
        try:
            with time_cap(min(CAPS_S[phase], left)):
                actions[phase](run)
            done[phase] = {"ok": True}
        except Exception as err:  # a phase's failure is a result; the next phase still runs
            traceback.print_exc()
            done[phase] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        done[phase]["seconds"] = round(time.perf_counter() - t0, 1)
        run.save()
    checks = run.results.get("checks", [])
    run.results["ok"] = all(p["ok"] for p in done.values()) and all(c["ok"] for c in checks)
    run.save()
    return bool(run.results["ok"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachesvc.bench.gpu_check", description=__doc__)
    parser.add_argument("--out", default="gpu-check-out", help="folder for results.json")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    parser.add_argument("--backend", default="flashinfer", help="backend under test")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="one timing cell per benchmark")
    parser.add_argument("--model", help="GGUF file or HF folder (default: random weights)")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; known: {PHASES}")
    run = Run(Path(args.out), args.backend, args.device, args.quick, args.model, {})
    info = {"python": platform.python_version(), "torch": torch.__version__}
    info["torch_cuda"] = str(torch.version.cuda)
    if args.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    with suppress(PackageNotFoundError):
        info["flashinfer"] = version("flashinfer-python")
    run.results["versions"] = info
    print(json.dumps(info), flush=True)
    ok = run_phases(run, phases)
    print(f"gpu_check: {'PASS' if ok else 'FAIL'}; results in {run.out / 'results.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
