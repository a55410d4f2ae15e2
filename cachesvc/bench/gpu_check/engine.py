"""Phase 3 of the GPU check (`gpu_check`): a SmolLM2-shaped bf16 model through the backend,
teacher-forced logits and greedy tokens against the torch backend on the same device."""

from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from cachesvc.bench.gpu_check import correctness as correctness
from cachesvc.bench.gpu_check.report import Run
from workers.attention.layout import build_layout
from workers.attention.schemes import make_scheme_backend

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
    # std 0.02, Llama's initializer_range: at 0.05, bf16 rounding moved a top-2 gap by more
    # than half the median gap, leaving greedy tokens little to compare between near-ties.
    weights = {
        k: torch.ones(t.shape) if k.endswith("norm") else torch.randn(t.shape, generator=gen) * 0.02
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


def generate(run: Run, loaded: Any, backend_name: str) -> list[list[correctness.Pick]]:
    """Greedy picks for four prompts, three sharing a 64-token prefix, through the engine."""
    from workers.config import EngineConfig
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
    picks: dict[Any, list[correctness.Pick]] = defaultdict(list)
    execute = engine.runner.execute

    def recording(output: Any, requests: Any, keep_logits: Any = ()) -> Any:
        # Every sampled row's logits kept (the engine keeps only those that forks need), for
        # the top-2 gap behind each greedy token.
        result = execute(output, requests, requests)
        for rid in result.sampled:
            picks[rid].append(correctness.Pick.of(result.logits[rid]))
        return result

    engine.runner.execute = recording  # type: ignore[method-assign]
    outputs = engine.generate(prompts, params)
    for out in outputs:
        assert tuple(p.token for p in picks[out.request_id]) == out.token_ids
    return [picks[out.request_id] for out in outputs]


def phase_engine(run: Run) -> None:
    models = load_models(run)
    low, fp32 = models[torch.bfloat16], models[torch.float32]
    ref32 = teacher_forced_logits(run, fp32, "torch")
    ref_low = teacher_forced_logits(run, low, "torch")
    got = teacher_forced_logits(run, low, run.backend)
    err_ref, err = float((ref_low - ref32).abs().max()), float((got - ref32).abs().max())
    ok = err <= correctness.ERROR_RATIO * err_ref
    ratio = err / err_ref if err_ref else math.inf
    run.check("engine logits vs float32", ok, max_err=err, torch_bf16_err=err_ref, ratio=ratio)
    resolution = correctness.gap_resolution(ref_low, ref32)
    picks = run.guarded("engine generate", partial(generate, run, low, run.backend))
    ref_picks = generate(run, low, "torch")
    if picks is None:
        return
    agreement = correctness.greedy_agreement(picks, ref_picks, resolution, torch.bfloat16)
    run.results["engine_generate"] = {
        "tokens": [[p.token for p in seq] for seq in picks],
        "torch_bf16_tokens": [[p.token for p in seq] for seq in ref_picks],
        "resolution": resolution,
        "compared": agreement.compared,
        "near_ties": agreement.near_ties,
        "parted": agreement.parted,
    }
    run.check(
        "engine greedy tokens vs torch bf16",
        agreement.ok,
        agreement.first_mismatch,
        compared=agreement.compared,
        near_ties=agreement.near_ties,
        parted=agreement.parted,
        resolution=resolution,
    )
