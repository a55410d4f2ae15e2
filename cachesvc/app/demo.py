"""The `make run` demo: a few chat prompts through the engine, with timings."""

from __future__ import annotations

import time

from workers.config import EngineConfig

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in one sentence what a KV cache is.",
    "Give me three tips for writing clean Python code.",
)


def run_demo(config: EngineConfig, max_tokens: int = 48) -> int:
    """Load the model, answer DEMO_QUESTIONS as one batch, print answers and timings."""
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(config)
    if engine.tokenizer is None:
        print("the demo needs a model with a tokenizer")
        return 2
    tokenizer = engine.tokenizer
    load_s = time.perf_counter() - t0
    print(
        f"model {engine.loaded.path.name}: loaded in {load_s:.1f} s, "
        f"{engine.pool.num_blocks} KV blocks of {config.block_size} tokens"
    )
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in DEMO_QUESTIONS
    ]
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    wall = time.perf_counter() - t0
    for question, out in zip(DEMO_QUESTIONS, outputs, strict=True):
        tps = f"{out.decode_tokens_per_s:.1f}" if out.decode_tokens_per_s else "n/a"
        print(f"\n> {question}\n{out.text.strip()}")
        print(
            f"  [{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
            f"TTFT {out.ttft_ms:.0f} ms, decode {tps} tok/s per request]"
        )
    total = sum(len(o.token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests in one batch: {total} tokens in {wall:.1f} s "
        f"({total / wall:.1f} tok/s overall)"
    )
    return 0
