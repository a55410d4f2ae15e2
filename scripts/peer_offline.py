"""Our engine and vLLM's CPU build offline, on the same token prompts: the engines alone, with no
server, router, Ray or HTTP between them and the prompts.

    python scripts/peer_offline.py --venv ~/peer/venv --hf-folder ~/peer/smollm2-f32 \\
        [--threads 2] [--prompts 16] [--prompt-tokens 1050] [--max-tokens 32] [--rounds 2] \\
        [--seed 0] [--json FILE]

Each round runs vLLM, then ours, then ours, then vLLM (A B B A), each in a fresh process: the
same `--prompts` random prompts of `--prompt-tokens` token ids (drawn from `--seed` and the
round), all given at once, `--max-tokens` greedy tokens each with the end-of-sequence token
ignored, after a warm-up of one short prompt. Both engines take 2,048 tokens a step at most
(vLLM's server default on CPU; its offline `LLM` class would take 4,096), float32, and the
threads: ours `--threads`, vLLM's bound to cores 0.. as `scripts/serve_alternated.sh` runs its
server. The venv and the weights are those `scripts/peer_vllm.py` makes; our engine loads the
same tensors from its own copy of the model.

Prints, per round and engine, the seconds the batch took, and whether the greedy tokens agree
with the other engine's on every prompt; `--json` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MAX_BATCHED_TOKENS = 2048
TOKEN_RANGE = (100, 40000)  # ordinary vocabulary ids, no special tokens


def prompts_of(seed: int, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids, the same for both engines."""
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(count)]


def run_ours(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Our Engine over `prompts`: seconds and each prompt's output ids."""
    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            num_threads=args.threads,
            kv_cache_mb=4096,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
        )
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:50]], params)  # warm: threads, kernels, the heap
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": [list(o.token_ids) for o in outputs]}


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM's LLM over `prompts` (run in the peer venv): seconds and each prompt's output ids."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.hf_folder,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,  # as its server runs in the side-by-side
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:50])], params, use_tqdm=False)
    start = time.perf_counter()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": [list(r.outputs[0].token_ids) for r in results]}


def child(args: argparse.Namespace) -> None:
    """One engine, one batch: the result as one JSON line on stdout."""
    prompts = prompts_of(args.prompt_seed, args.prompts, args.prompt_tokens)
    result = run_ours(args, prompts) if args.child == "ours" else run_vllm(args, prompts)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(args: argparse.Namespace, engine: str, prompt_seed: int) -> dict[str, Any]:
    """Run one engine in a fresh process (ours in this interpreter, vLLM in the peer venv's)."""
    python = sys.executable if engine == "ours" else str(Path(args.venv) / "bin" / "python")
    env = dict(os.environ)
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "4"
        if args.threads > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    command = [python, __file__, "--child", engine, "--prompt-seed", str(prompt_seed)]
    command += ["--hf-folder", args.hf_folder, "--threads", str(args.threads)]
    command += ["--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens)]
    command += ["--max-tokens", str(args.max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{engine} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/peer_offline.py")
    parser.add_argument("--venv", help="the peer venv scripts/peer_vllm.py made")
    parser.add_argument("--hf-folder", required=True, help="the weights scripts/peer_vllm.py wrote")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1050)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--child", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--prompt-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if not args.venv:
        parser.error("--venv is required")
    rows = []
    for round_no in range(1, args.rounds + 1):
        prompt_seed = args.seed * 1000 + round_no
        results: dict[str, list[dict[str, Any]]] = {"ours": [], "vllm": []}
        for engine in ("vllm", "ours", "ours", "vllm"):
            results[engine].append(spawn(args, engine, prompt_seed))
            print(f"round {round_no} {engine}: {results[engine][-1]['seconds']:.2f} s", flush=True)
        ours, theirs = results["ours"][0]["outputs"], results["vllm"][0]["outputs"]
        agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
        for engine, runs in results.items():
            for run in runs:
                rows.append({"round": round_no, "engine": engine, "seconds": run["seconds"]})
        rows.append({"round": round_no, "prompts_agreeing": agree, "prompts": args.prompts})
        print(f"round {round_no}: greedy tokens agree on {agree} of {args.prompts} prompts")
    report = {
        "threads": args.threads,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "max_batched_tokens": MAX_BATCHED_TOKENS,
        "rows": rows,
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
