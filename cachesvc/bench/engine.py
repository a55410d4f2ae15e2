"""`cachesvc bench engine`: our prefill and decode tokens/s against Hugging Face transformers.

Both run the same dequantized float32 weights on the same random prompts in the same process,
one after the other, so the ratio is meaningful on a noisy machine. Prefill tokens/s counts the
batch's prompt tokens over the time to the batch's last first token; decode tokens/s counts the
tokens generated after that over the remaining time.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from cachesvc.workloads.table import format_table, write_json


@dataclass(frozen=True)
class Speed:
    prefill_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class EngineBenchRow:
    batch: int
    prompt_len: int
    new_tokens: int
    ours: Speed
    hf: Speed | None


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Avoid the low ids, which hold special tokens in most vocabularies.
    return torch.randint(100, vocab, (batch, prompt_len), generator=gen).tolist()


def _ours(engine: Any, prompts: list[list[int]], new_tokens: int) -> Speed:
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    first_done: float | None = None
    seen: set[str] = set()
    while engine.has_unfinished():
        for out in engine.step():
            seen.add(out.request_id)
        if first_done is None and len(seen) == len(prompts):
            first_done = time.perf_counter()
    end = time.perf_counter()
    assert first_done is not None
    num_prompt = sum(len(p) for p in prompts)
    decode_s = max(end - first_done, 1e-9)
    return Speed(num_prompt / (first_done - t0), len(prompts) * (new_tokens - 1) / decode_s)


def _hf(model: Any, prompts: list[list[int]], new_tokens: int) -> Speed:
    """transformers' own generate: prefill = a 1-token generate, decode = the difference."""
    ids = torch.tensor(prompts)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - t0

    with torch.inference_mode():
        prefill_s = timed(1)
        total_s = timed(new_tokens)
    decode_s = max(total_s - prefill_s, 1e-9)
    return Speed(ids.numel() / prefill_s, len(prompts) * (new_tokens - 1) / decode_s)


def _load_hf(path: Any) -> Any:
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def run_engine_bench(
    model: str | None, quick: bool, json_path: str | None, with_hf: bool = True
) -> int:
    """Print the table (and write JSON); returns the process exit status."""
    from workers.config import EngineConfig
    from workers.engine.engine import Engine

    prompt_len, new_tokens = (32, 8) if quick else (128, 16)
    batches = (1, 8, 32)
    engine = Engine(EngineConfig(model=model, max_num_batched_tokens=4096, kv_cache_mb=1024))
    hf_model = _load_hf(engine.loaded.path) if with_hf else None
    # One untimed warm-up of each, so first-call allocation does not count.
    warm = _prompts(2, 16, engine.loaded.config.vocab_size, seed=0)
    _ours(engine, warm, 2)
    if hf_model is not None:
        _hf(hf_model, warm, 2)
    rows = []
    for batch in batches:
        prompts = _prompts(batch, prompt_len, engine.loaded.config.vocab_size, seed=batch)
        ours = _ours(engine, prompts, new_tokens)
        hf = _hf(hf_model, prompts, new_tokens) if hf_model is not None else None
        rows.append(EngineBenchRow(batch, prompt_len, new_tokens, ours, hf))
        print(f"batch {batch}: done", flush=True)
    _print(rows, engine)
    write_json(
        json_path,
        {
            "suite": "engine",
            "model": engine.loaded.path.name,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "rows": [asdict(r) for r in rows],
        },
    )
    return 0


def _print(rows: list[EngineBenchRow], engine: Any) -> None:
    table = []
    for r in rows:
        hf = r.hf
        table.append(
            [
                r.batch,
                r.prompt_len,
                r.new_tokens,
                r.ours.prefill_tok_s,
                hf.prefill_tok_s if hf else "-",
                r.ours.prefill_tok_s / hf.prefill_tok_s if hf else "-",
                r.ours.decode_tok_s,
                hf.decode_tok_s if hf else "-",
                r.ours.decode_tok_s / hf.decode_tok_s if hf else "-",
            ]
        )
    print(f"\nmodel {engine.loaded.path.name}, float32, {torch.get_num_threads()} threads")
    print(
        format_table(
            [
                "batch",
                "prompt",
                "new",
                "prefill tok/s ours",
                "HF",
                "ratio",
                "decode tok/s ours",
                "HF",
                "ratio",
            ],
            table,
        )
    )
