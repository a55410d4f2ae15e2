"""Load a model from a GGUF file or a Hugging Face folder, with its fingerprint.

The fingerprint names the model in every block hash (DESIGN.md, "Hashing"): it must be equal for
the same weights and dtype in every process and after every restart, and differ otherwise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from workers.model.config import ModelConfig, ModelLoadError
from workers.model.cpu_dtype import check_dtype_supported
from workers.model.llama import LlamaModel
from workers.model.weights import WeightSource, build_state_dict

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "model_fingerprint"]

_FINGERPRINT_TAG = b"cachesvc-model-v1"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for `forward`, with what identifies it."""

    model: LlamaModel
    config: ModelConfig
    fingerprint: str  # 32 hex chars
    path: Path
    load_seconds: float = 0.0  # wall time of load_model


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder (config.json + *.safetensors); None: the default.

    GGUF weights are dequantized and all weights cast to `dtype` on `device`; the KV cache is
    assumed to use `dtype` too (it enters the fingerprint). Raises ModelLoadError for a missing
    path, an unknown architecture, a bad config or a missing/misshapen tensor, and for bfloat16
    on a CPU without native bfloat16 (`check_dtype_supported`).
    """
    check_dtype_supported(dtype, device)
    start = time.perf_counter()
    resolved = _resolve(path)
    source = _open(resolved)
    state = build_state_dict(source, dtype=dtype, device=device)
    model = LlamaModel(
        source.config, dtype=dtype, device=device, rope_freq_factors=source.rope_freq_factors
    )
    # assign=True adopts the tensors instead of copying them into the empty parameters.
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    model.pack_weights()
    return LoadedModel(
        model=model,
        config=source.config,
        fingerprint=model_fingerprint(source.config, dtype, source.identity),
        path=resolved,
        load_seconds=time.perf_counter() - start,
    )


def model_fingerprint(config: ModelConfig, kv_dtype: torch.dtype, weights_identity: bytes) -> str:
    """xxh3-128 hex digest of the config (architecture, shapes, RoPE), KV dtype and weights."""
    digest = xxhash.xxh3_128()
    for part in (
        _FINGERPRINT_TAG,
        json.dumps(config.to_dict(), sort_keys=True).encode(),
        str(kv_dtype).encode(),
        weights_identity,
    ):
        # Length-prefixed, so no two different part lists hash the same bytes.
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def _resolve(path: str | Path | None) -> Path:
    if path is None:
        from workers.text.default_model import default_model_path

        try:
            return default_model_path()
        except FileNotFoundError as err:
            raise ModelLoadError(str(err)) from err
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path {resolved} does not exist")
    return resolved


def _open(path: Path) -> WeightSource:
    # Sub-loaders import gguf / safetensors; import only the one this path needs.
    if path.is_dir():
        from workers.model.hf_loader import open_hf_folder

        return open_hf_folder(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is neither a GGUF file nor a Hugging Face folder (config.json + *.safetensors)"
        )
    from workers.model.gguf_loader import open_gguf

    return open_gguf(path)
