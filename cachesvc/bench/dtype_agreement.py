"""`cachesvc bench dtype-agreement`: how closely our bfloat16 engine follows Hugging Face's.

The same prompts (the fidelity tests' held ones, plus random-token ones of many lengths) run
greedy through our engine and through transformers, each in bfloat16 and float32, the HF model
loaded from the same GGUF weights. For each pair of runs it reports the share of prompts whose
first K tokens are identical, the mean tokens before the first divergence and, at each
divergence, the float32 model's logit margin between the two tokens chosen: a margin near zero
is a tie that any rounding may break, a large one a numerical fault.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachesvc.workloads.table import write_json

HELD_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three children. Every morning he",
    "Q: What is 17 times 3?\nA:",
    "Les chats sont",
    "List three primary colors:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Hello",
)
# The held texts the fidelity tests send as a chat (the first three), the rest as plain text.
NUM_CHAT = 3
# A divergence where the float32 model's two candidates lie closer than this (logits) is a tie:
# bfloat16 keeps 8 bits of mantissa, so a logit of 16-32 moves by up to 0.125 in one rounding.
NEAR_TIE = 0.25
# (ours, reference): the pairs the report compares.
PAIRS = (
    ("ours_bf16", "hf_bf16"),
    ("ours_bf16", "ours_fp32"),
    ("hf_bf16", "hf_fp32"),
    ("ours_fp32", "hf_fp32"),
)


@dataclass(frozen=True)
class DtypeAgreementArgs:
    """What `cachesvc bench dtype-agreement` runs; the flags of the same names."""

    json_path: str | None = None
    quick: bool = False
    model: str | None = None
    threads: int | None = None
    tokens: int | None = None  # K, greedy tokens a prompt (default 64, quick 24)
    generated: int | None = None  # random-token prompts besides the held ones (16, quick 4)

    def __post_init__(self) -> None:
        for name in ("threads", "tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        if self.generated is not None and self.generated < 0:
            raise ValueError(f"--generated must be >= 0, got {self.generated}")


@dataclass(frozen=True)
class Divergence:
    """Where a run's greedy tokens first leave its reference's, and how close that call was."""

    at: int  # tokens identical before it; K when the run agrees all the way
    margin: float | None  # float32 logit(reference's token) - logit(run's token); None: agrees


def held_prompts(tokenizer: Any) -> list[list[int]]:
    """The fidelity tests' prompts as token ids (the first `NUM_CHAT` as chat turns)."""
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}])
        for t in HELD_TEXTS[:NUM_CHAT]
    ]
    return [tokenizer.encode(t) for t in (*chats, *HELD_TEXTS[NUM_CHAT:])]


def generated_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` random-token prompts, lengths spread over 8 to 512 tokens."""
    rng = random.Random(seed)
    lengths = [int(8 * 64 ** (i / max(count - 1, 1))) for i in range(count)]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def load_hf(path: Any, dtype: torch.dtype) -> Any:
    """Transformers' model of a GGUF file or HF folder, in `dtype` (as the fidelity tests do).

    Below float32 a GGUF file is dequantized whole, then cast: transformers would otherwise keep
    the weights packed and compute every matmul in float32, which is not a bfloat16 model.
    """
    from pathlib import Path

    from transformers import AutoModelForCausalLM, GgufConfig

    path = Path(path)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    kw = {} if dtype == torch.float32 else {"quantization_config": GgufConfig(dequantize=True)}
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, **kw
    ).eval()


def hf_greedy(model: Any, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """Greedy continuation by transformers with its own KV cache, never stopping."""
    out: list[int] = []
    ids, past = torch.tensor([list(prompt)]), None
    with torch.inference_mode():
        for _ in range(num_tokens):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def engine_greedy(engine: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens of our engine for every prompt, batched, never stopping."""
    from workers.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, greedy)]


def divergence(
    exact: Any, prompt: Sequence[int], tokens: Sequence[int], reference: Sequence[int]
) -> Divergence:
    """Where `tokens` first differ from `reference`, with the margin by `exact` (an HF model,
    float32) between the two tokens chosen there, after the prompt and the tokens shared."""
    at = next(
        (i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), len(tokens)
    )
    if at == len(tokens):
        return Divergence(at, None)
    with torch.inference_mode():
        logits = exact(torch.tensor([[*prompt, *reference[:at]]])).logits[0, -1].float()
    return Divergence(at, float(logits[reference[at]] - logits[tokens[at]]))


def summarize(divergences: list[Divergence], num_tokens: int) -> dict[str, Any]:
    """Agreement of one pair of runs over all prompts."""
    # A margin below zero: the run's token is the float32 model's choice, the reference's not.
    margins = sorted(abs(d.margin) for d in divergences if d.margin is not None)
    return {
        "prompts": len(divergences),
        "identical_share": sum(d.margin is None for d in divergences) / len(divergences),
        "mean_tokens_before_divergence": statistics.mean(d.at for d in divergences),
        "divergences": len(margins),
        "near_ties": sum(m < NEAR_TIE for m in margins),
        "margin_median": statistics.median(margins) if margins else None,
        "margin_max": margins[-1] if margins else None,
        "margins": margins,
        "first_divergence": [d.at if d.margin is not None else None for d in divergences],
        "tokens": num_tokens,
    }


def run_dtype_agreement_bench(args: DtypeAgreementArgs) -> int:
    """Print the agreement table (and write JSON); returns 0."""
    from workers.config import EngineConfig
    from workers.engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    num_tokens = args.tokens or (24 if args.quick else 64)
    runs: dict[str, list[list[int]]] = {}
    engines = {}
    for name, dtype in (("ours_fp32", "float32"), ("ours_bf16", "bfloat16")):
        engines[name] = Engine(EngineConfig(model=args.model, dtype=dtype, num_blocks=1024))
    engine = engines["ours_fp32"]
    generated = args.generated if args.generated is not None else (4 if args.quick else 16)
    prompts = held_prompts(engine.tokenizer) + generated_prompts(
        engine.loaded.config.vocab_size, generated
    )
    for name, eng in engines.items():
        runs[name] = engine_greedy(eng, prompts, num_tokens)
    path = engine.loaded.path
    del engines, engine
    hf = {name: load_hf(path, dtype) for name, dtype in _HF_DTYPES.items()}
    for name, model in hf.items():
        runs[name] = [hf_greedy(model, p, num_tokens) for p in prompts]
    pairs = []
    for ours, ref in PAIRS:
        divs = [
            divergence(hf["hf_fp32"], p, t, r)
            for p, t, r in zip(prompts, runs[ours], runs[ref], strict=True)
        ]
        pairs.append({"run": ours, "reference": ref} | summarize(divs, num_tokens))
    report = {
        "model": path.name,
        "threads": torch.get_num_threads(),
        "near_tie": NEAR_TIE,
        "held_prompts": len(HELD_TEXTS),
        "generated_prompts": generated,
        "prompt_lens": [len(p) for p in prompts],
        "pairs": pairs,
    }
    _print_report(report)
    write_json(args.json_path, report)
    return 0


_HF_DTYPES = {"hf_fp32": torch.float32, "hf_bf16": torch.bfloat16}


def _print_report(report: dict[str, Any]) -> None:
    tokens = report["pairs"][0]["tokens"]
    print(
        f"{report['model']}, {len(report['prompt_lens'])} prompts ({report['held_prompts']} held,"
        f" {report['generated_prompts']} random), {tokens} greedy tokens, "
        f"{report['threads']} threads; margins are float32 logits, a tie < {report['near_tie']}"
    )
    print(
        f"{'run vs reference':<24} {'identical':>9} {'mean before div':>15} {'divs':>5} "
        f"{'ties':>5} {'margin p50':>10} {'margin max':>10}"
    )
    for s in report["pairs"]:
        name = f"{s['run']}_vs_{s['reference']}"
        p50 = "-" if s["margin_median"] is None else f"{s['margin_median']:.3f}"
        top = "-" if s["margin_max"] is None else f"{s['margin_max']:.3f}"
        print(
            f"{name:<24} {s['identical_share']:>9.0%} {s['mean_tokens_before_divergence']:>15.1f}"
            f" {s['divergences']:>5} {s['near_ties']:>5} {p50:>10} {top:>10}"
        )
