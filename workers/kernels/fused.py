"""A decoder layer's elementwise steps as one pass each on CPU (`csrc/fused_ops.cpp`):
`torch.ops.cachesvc.{rms_norm, add_rms_norm, rope_qk, silu_mul}`. The model calls them through
`workers.model.layer_ops.LayerOps`, which falls back to torch's ops where they do not apply."""

from __future__ import annotations

from pathlib import Path

from workers.kernels.build import load_library

_SOURCE = Path(__file__).with_name("csrc") / "fused_ops.cpp"


def load() -> bool:
    """Whether the elementwise ops are available, building them on first call."""
    return load_library(_SOURCE)
