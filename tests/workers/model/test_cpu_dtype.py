"""bfloat16 loads where the CPU computes it natively and is refused, naming the fix, where not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.model import cpu_dtype
from workers.model.loader import ModelLoadError, load_model
from workers.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-bf16"))


def test_probe_agrees_with_cpuinfo() -> None:
    flags = cpu_dtype._linux_cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to compare with")
    native = {"avx512_bf16", "amx_bf16"} & flags
    assert bool(cpu_dtype.cpu_bf16_features()) == bool(native or "bf16" in flags)


def test_bfloat16_on_a_cpu_without_it_is_refused(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU cannot be changed: the probe answers as a CPU without bf16 would.
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_features", lambda: ())
    with pytest.raises(ModelLoadError, match=r"native bfloat16.*use --dtype float32"):
        load_model(tiny_dir, dtype=torch.bfloat16)
    assert load_model(tiny_dir).model.embed_tokens.dtype == torch.float32


def test_bfloat16_loads_where_the_cpu_has_it(tiny_dir: Path) -> None:
    if not cpu_dtype.cpu_bf16_features():
        pytest.skip("this CPU has no native bfloat16")
    loaded = load_model(tiny_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.fingerprint != load_model(tiny_dir).fingerprint  # blocks never mix dtypes
