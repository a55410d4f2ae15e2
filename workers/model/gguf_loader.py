"""Open a GGUF file: metadata to `ModelConfig`, llama.cpp tensor names to Hugging Face names.

Tensors are dequantized to float32 by `gguf.quants` when read. llama.cpp's converter permutes the
rows of Llama's q and k projections (its RoPE rotates adjacent pairs, HF's rotates halves);
`_unpermute` undoes it so our rotate-half RoPE applies.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
import xxhash
from gguf.quants import dequantize

from workers.model.config import ModelConfig, ModelLoadError
from workers.model.gguf_file import GGUFFile, GGUFTensor, read_gguf
from workers.model.weights import WeightSource

_SAMPLE_BYTES = 1 << 20
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's `permute`: per head, rows (pair, 2) back to (2, pair)."""
    rows = tensor.shape[0]
    heads = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return heads.transpose(1, 2).reshape(tensor.shape)


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    try:
        array = dequantize(tensor.data, tensor.qtype)
    except NotImplementedError as err:
        raise ModelLoadError(f"tensor {tensor.name!r}: {err}") from err
    # F32 tensors come back as read-only views of the memory map: copy those, and only those.
    return torch.from_numpy(np.require(array, dtype=np.float32, requirements=["C", "W"]))


def open_gguf(path: Path) -> WeightSource:
    """Parse the header and metadata; tensors are dequantized later, one at a time.

    Raises ModelLoadError for a file that is not GGUF, an unsupported architecture or a config
    the metadata cannot supply.
    """
    gguf = read_gguf(path)
    tensors = {hf: t for t in gguf.tensors.values() if (hf := hf_name(t.name)) is not None}
    metadata = dict(gguf.metadata)
    arch = metadata.get("general.architecture")
    if f"{arch}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in gguf.array_lengths:
        metadata[f"{arch}.vocab_size"] = gguf.array_lengths["tokenizer.ggml.tokens"]
    config = ModelConfig.from_gguf_metadata(
        metadata,
        tie_word_embeddings="lm_head.weight" not in tensors,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
    )
    # Only the "llama" converter permutes; Qwen2 GGUFs keep HF's row order.
    permuted = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    permuted = permuted if config.architecture == "llama" else {}

    def read(name: str) -> torch.Tensor:
        out = _dequantize(tensors[name])
        proj = name.split(".")[-2]
        return _unpermute(out, permuted[proj]) if proj in permuted else out

    freqs = gguf.tensors.get("rope_freqs.weight")
    return WeightSource(
        config=config,
        tensor_names=frozenset(tensors),
        read=read,
        identity=_identity(gguf),
        rope_freq_factors=None if freqs is None else _dequantize(freqs),
    )


def _identity(gguf: GGUFFile) -> bytes:
    """Digest of the file size, header + metadata + tensor table, and the data's first/last MiB."""
    data, offset = gguf.mmap, gguf.data_offset
    size = len(data)
    head = data[: min(size, offset + _SAMPLE_BYTES)].tobytes()
    tail = data[max(offset, size - _SAMPLE_BYTES) :].tobytes()
    digest = xxhash.xxh3_128()
    for part in (struct.pack("<Q", size), head, tail):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.digest()
