"""load_model: config parsing, fingerprints, and typed errors for bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.model.config import ModelConfig, ModelLoadError
from workers.model.gguf_loader import hf_name
from workers.model.loader import load_model

TINY: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


def save_tiny(folder: Path, seed: int, **overrides: Any) -> Path:
    """A random tiny Llama folder written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = {k: v for k, v in {**TINY, **overrides}.items() if k != "model_type"}
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


def test_fingerprint_is_stable_across_loads_and_processes(tiny_dir: Path) -> None:
    first, second = load_model(tiny_dir), load_model(str(tiny_dir))
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 32 and int(first.fingerprint, 16) >= 0
    code = (
        "from workers.model.loader import load_model; "
        f"print(load_model({str(tiny_dir)!r}).fingerprint)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).parents[3],  # the repository root, so `workers` imports
    )
    assert out.stdout.strip() == first.fingerprint


def test_fingerprint_differs_for_other_weights_shape_or_dtype(
    tiny_dir: Path, tmp_path: Path
) -> None:
    base = load_model(tiny_dir).fingerprint
    other_seed = load_model(save_tiny(tmp_path / "seed1", seed=1)).fingerprint
    other_theta = load_model(save_tiny(tmp_path / "theta", seed=0, rope_theta=500.0)).fingerprint
    bf16 = load_model(tiny_dir, dtype=torch.bfloat16).fingerprint
    assert len({base, other_seed, other_theta, bf16}) == 4


def test_loaded_model_reports_config_and_path(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, dtype=torch.bfloat16)
    assert loaded.path == tiny_dir
    assert loaded.config == ModelConfig.from_hf_dict(
        json.loads((tiny_dir / "config.json").read_text())
    )
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_folder_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_folder_without_weights_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_unknown_architecture_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(tmp_path)


def test_missing_tensor_raises(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = load_file(tiny_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="k_proj"):
        load_model(tmp_path)


def test_misshapen_tensor_raises(tiny_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    (tmp_path / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(tmp_path)


def test_file_that_is_not_gguf_raises(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF"):
        load_model(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": {"type": "linear", "factor": -1.0}}, "positive"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_bad_hf_config_raises(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict({**TINY, **change})


def test_hf_config_flavours() -> None:
    qwen = ModelConfig.from_hf_dict({**TINY, "model_type": "qwen2", "sliding_window": 64})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    old = ModelConfig.from_hf_dict(
        {**TINY, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_hf_dict(
        {**TINY, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    )
    assert old == new and old.rope_theta == 5e5 and old.rope_type == "linear"
    assert ModelConfig.from_hf_dict({**TINY, "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    assert ModelConfig.from_hf_dict(TINY).head_dim == 8


def test_gguf_metadata_to_config() -> None:
    metadata = {
        "general.architecture": "llama",
        "llama.vocab_size": 64,
        "llama.context_length": 2048,
        "llama.embedding_length": 32,
        "llama.block_count": 2,
        "llama.feed_forward_length": 48,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 1e4,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 5,
    }
    config = ModelConfig.from_gguf_metadata(metadata, tie_word_embeddings=True, qkv_bias=False)
    assert (config.num_layers, config.head_dim, config.max_position_embeddings) == (2, 8, 2048)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == (2, 5) and config.tie_word_embeddings
    with pytest.raises(ModelLoadError, match="feed_forward_length"):
        ModelConfig.from_gguf_metadata(
            {k: v for k, v in metadata.items() if "feed_forward" not in k},
            tie_word_embeddings=True,
            qkv_bias=False,
        )
    with pytest.raises(ModelLoadError, match="gemma"):
        ModelConfig.from_gguf_metadata(
            {"general.architecture": "gemma"}, tie_word_embeddings=True, qkv_bias=False
        )


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_q.bias", "model.layers.12.self_attn.q_proj.bias"),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("rope_freqs.weight", None),
    ],
)
def test_gguf_tensor_names(gguf: str, hf: str | None) -> None:
    assert hf_name(gguf) == hf


def write_gguf(folder: Path, path: Path) -> None:
    """Convert a tiny HF folder to an F32 GGUF the way llama.cpp does, q/k permutation included."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch, heads = config["model_type"], config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    shorts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    candidates = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.{i}.{short}.{kind}"
        for i in range(config["num_hidden_layers"])
        for short in [*shorts, "ffn_gate", "ffn_up", "ffn_down"]
        for kind in ("weight", "bias")
    ]
    to_gguf = {hf_name(name): name for name in candidates}
    for name, tensor in load_file(folder / "model.safetensors").items():
        array = tensor.numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else config["num_key_value_heads"]
            # llama.cpp's permute: per head, rows (2, pair) -> (pair, 2).
            array = array.reshape(n, 2, -1, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        writer.add_tensor(to_gguf[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)]
)
def test_gguf_gives_the_same_model_as_safetensors(arch: str, tied: bool, tmp_path: Path) -> None:
    import dataclasses

    import transformers

    config_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    torch.manual_seed(3)
    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    hf_config = config_cls(**shape, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_gguf(tmp_path, tmp_path / "model.gguf")
    from_hf, from_gguf = load_model(tmp_path), load_model(tmp_path / "model.gguf")
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps, rel=1e-6)
    # GGUF stores the epsilon as float32, so it differs in the last digits.
    eps = from_hf.config.rms_norm_eps
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=eps) == from_hf.config
    ours, theirs = from_gguf.model.state_dict(), from_hf.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert from_gguf.fingerprint != from_hf.fingerprint
