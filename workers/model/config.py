"""The shape and hyper-parameters of a Llama-family model, read from config.json or GGUF metadata.

One frozen `ModelConfig` describes Llama, Qwen2 and Mistral: they differ only in flags (Qwen2's
q/k/v bias) that the forward pass reads, and in Mistral's sliding window, which caps the context
(`max_context_len`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral")
# "dynamic" NTK equals "default" up to max_position_embeddings, the length our RoPE table covers.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


class ModelLoadError(ValueError):
    """A model cannot be loaded: missing file or tensor, unknown architecture, bad config."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape; validated on creation."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # HF rope parameters with a "rope_type" key; a mapping is unhashable, so hash() skips it.
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    # Not applied by attention, which always sees the whole context: `max_context_len` caps
    # every sequence at the window instead, where the two are the same.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            # Frozen all the way down, so a config can be shared and hashed safely.
            object.__setattr__(self, "rope_scaling", MappingProxyType(dict(self.rope_scaling)))
        self._validate()

    def _validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(
            self.num_heads > 0
            and self.num_kv_heads > 0
            and self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
            f"({self.num_kv_heads})",
        )
        _require(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim must be even, got {self.head_dim}",
        )
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        _require(
            self.max_position_embeddings > 0,
            f"max_position_embeddings must be positive, got {self.max_position_embeddings}",
        )
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)
        _require(
            self.sliding_window is None or self.sliding_window > 0,
            f"sliding_window must be positive or null, got {self.sliding_window}",
        )

    @property
    def max_context_len(self) -> int:
        """The longest sequence (prompt and output) this model computes exactly: the RoPE table's
        length, capped at the sliding window. Our attention has no window; up to the window's
        length every token sees all the others under windowed attention too, so capping the
        context keeps it exact."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, in field order (used by the model fingerprint)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(sorted(value.items()))
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_hf_dict(cls, config_json: Mapping[str, Any]) -> ModelConfig:
        """From a HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`).

        Raises ModelLoadError naming the missing or unsupported field.
        """
        arch = config_json.get("model_type")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"config.json model_type {arch!r} is not supported; supported: {ARCHITECTURES}"
            )
        if config_json.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {config_json['hidden_act']!r} unsupported; need silu")
        if config_json.get("mlp_bias", False):
            raise ModelLoadError("mlp_bias=true is not supported")
        hidden, heads = _get(config_json, "hidden_size"), _get(config_json, "num_attention_heads")
        theta, scaling = _hf_rope(config_json)
        attention_bias = bool(config_json.get("attention_bias", False))
        window = config_json.get("sliding_window")
        if arch == "qwen2" and not config_json.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=_get(config_json, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get(config_json, "intermediate_size"),
            num_layers=_get(config_json, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config_json.get("num_key_value_heads") or heads,
            head_dim=config_json.get("head_dim") or hidden // heads,
            rms_norm_eps=float(config_json.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_get(config_json, "max_position_embeddings"),
            tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            sliding_window=window,
            bos_token_id=config_json.get("bos_token_id"),
            eos_token_ids=_as_ids(config_json.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, tie_word_embeddings: bool, qkv_bias: bool
    ) -> ModelConfig:
        """From GGUF key/value metadata (`general.architecture`, `{arch}.block_count`, ...).

        `metadata` must hold `{arch}.vocab_size` (the loader fills it from the token list when the
        file lacks it). Whether the output matrix is tied and q/k/v carry a bias are read from the
        tensor list, so the caller passes them. Raises ModelLoadError on a missing key.
        """
        arch = metadata.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ModelLoadError(
                f"GGUF architecture {arch!r} is not supported; supported: ('llama', 'qwen2')"
            )

        def key(name: str) -> Any:
            return _get(metadata, f"{arch}.{name}")

        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        eos = [
            metadata.get("tokenizer.ggml.eos_token_id"),
            metadata.get("tokenizer.ggml.eot_token_id"),
        ]
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=str(arch),
            vocab_size=int(key("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(metadata, str(arch)),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=qkv_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ModelLoadError(f"invalid model config: {message}")


def _get(source: Mapping[str, Any], name: str) -> Any:
    if source.get(name) is None:
        raise ModelLoadError(f"model config lacks required field {name!r}")
    return source[name]


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _validate_rope_scaling(scaling: Mapping[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    _require(rope_type in ROPE_TYPES, f"rope_type {rope_type!r} unsupported; known: {ROPE_TYPES}")
    for name in _ROPE_REQUIRED.get(str(rope_type), ()):
        _require(scaling.get(name) is not None, f"rope_scaling {rope_type!r} needs {name!r}")
    factor = scaling.get("factor")
    _require(
        factor is None or (math.isfinite(factor) and factor > 0),
        f"rope_scaling factor must be positive, got {factor}",
    )


def _hf_rope(config_json: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from either config.json flavour."""
    params = dict(config_json.get("rope_parameters") or config_json.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config_json.get("rope_theta", 10000.0)))
    # transformers 4.x wrote "type"; 5.x writes "rope_type".
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _gguf_rope(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """llama.cpp's `rope.scaling.*` keys as HF rope parameters; llama3 uses a tensor instead."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling_type == "none" or factor in (None, 1.0):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        original = _get(metadata, f"{arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
    raise ModelLoadError(f"GGUF rope scaling type {scaling_type!r} is not supported")
