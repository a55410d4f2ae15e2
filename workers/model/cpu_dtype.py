"""Whether this CPU computes bfloat16 natively, and the refusal when it does not.

Without native bf16 dot products (x86 AVX512_BF16 or AMX, Arm's BF16 extension), torch widens
every bf16 operand to float32 and rounds the result back: the same arithmetic as float32 plus the
conversions, so a bf16 model is slower than a float32 one and less exact. A worker asked for
bfloat16 on such a CPU refuses to start rather than serve slower than its default.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from workers.model.config import ModelLoadError


def cpu_bf16_features() -> tuple[str, ...]:
    """This CPU's native bfloat16 features by their cpuinfo names; empty when it has none."""
    found = []
    if torch.cpu._is_avx512_bf16_supported():
        found.append("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        found.append("amx_bf16")
    if platform.machine().lower() in ("aarch64", "arm64") and "bf16" in _linux_cpu_flags():
        found.append("bf16")
    return tuple(found)


def check_dtype_supported(dtype: torch.dtype, device: str | torch.device) -> None:
    """Raise ModelLoadError when `dtype` is bfloat16 on a CPU without native bfloat16."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or cpu_bf16_features():
        return
    raise ModelLoadError(
        "dtype bfloat16 needs a CPU with native bfloat16 (avx512_bf16 or amx_bf16 on x86, bf16 "
        f"on Arm); this one ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()}) "
        "has none, and emulated bf16 is slower than float32: use --dtype float32"
    )


def _linux_cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    # x86 names them "flags", Arm "Features".
    return {
        word
        for line in text.splitlines()
        if line.split(":", 1)[0].strip() in ("flags", "Features")
        for word in line.split(":", 1)[1].split()
    }
