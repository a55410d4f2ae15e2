"""A decoder layer's elementwise steps, one pass each on CPU (`workers/kernels/csrc/fused_ops.cpp`).

`LayerOps` holds the four steps a Llama layer takes between its matmuls: RMSNorm, the residual
add with the RMSNorm after it, RoPE on the q and k heads of the fused projection's output, and
silu(gate) * up. `LayerOps(native=True)` runs them on the kernel where it is built and takes the
tensors (float32 or bfloat16 on the CPU); otherwise, and with `native=False`, on torch's ops,
whose arithmetic the kernel follows op by op (RoPE gives the same bits; RMSNorm's mean and
silu's exp differ in the last bits: see the source's header).

In eager torch these steps are ~30 dispatches a layer: ~5 ms of a 31 ms one-row decode step of
SmolLM2 on one thread (`cachesvc bench step`, docs/benchmarks/step.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels.fused import load
from workers.model.rope import apply_rope

_DTYPES = (torch.float32, torch.bfloat16)


def _takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return all(
        t.device.type == "cpu" and t.dtype == first.dtype and t.dtype in _DTYPES for t in tensors
    )


class LayerOps:
    """The elementwise steps of a layer, on the kernel (`native`, where it loads) or torch."""

    def __init__(self, native: bool) -> None:
        self.native = native and load()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of `x` `[T, H]` times `weight` `[H]`, as a new tensor."""
        if self.native and x.dim() == 2 and x.is_contiguous() and _takes(x, weight):
            out = torch.empty_like(x)
            torch.ops.cachesvc.rms_norm(x, weight, eps, out)
            return out
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm_(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`x += add` in place (the residual stream), then RMSNorm of `x` times `weight`, as a
        new tensor."""
        if (
            self.native
            and x.dim() == 2
            and x.is_contiguous()
            and add.is_contiguous()
            and add.shape == x.shape
            and _takes(x, add, weight)
        ):
            out = torch.empty_like(x)
            torch.ops.cachesvc.add_rms_norm(x, add, weight, eps, out)
            return out
        x.add_(add)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def rope_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int
    ) -> torch.Tensor:
        """The first `heads` heads of each row of `qkv` `[T, C]`, rotated (rotate-half RoPE),
        as a new `[T, heads, head_dim]`; `cos`, `sin` `[T, 1, head_dim / 2]` (`RotaryEmbedding.
        lookup`)."""
        num_tokens = qkv.shape[0]
        cos2, sin2 = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
        if (
            self.native
            and qkv.dim() == 2
            and qkv.stride(1) == 1
            and cos2.stride(1) == 1
            and sin2.stride(1) == 1
            and _takes(qkv, cos2, sin2)
        ):
            out = qkv.new_empty((num_tokens, heads, head_dim))
            torch.ops.cachesvc.rope_qk(qkv, cos2, sin2, heads, out)
            return out
        return apply_rope(qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim), cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows `[gate | up]` of `gate_up` `[T, 2 I]`, as a new `[T, I]`."""
        if self.native and gate_up.dim() == 2 and gate_up.is_contiguous() and _takes(gate_up):
            out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
            torch.ops.cachesvc.silu_mul(gate_up, out)
            return out
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate).mul_(up)
