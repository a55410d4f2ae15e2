"""Fixtures for the attention tests: the fake `flashinfer`, installed where the backend looks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import fake_flashinfer
import pytest
import torch

from workers.attention import flashinfer_backend


@pytest.fixture
def install_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Callable[..., ModuleType]:
    """Installs `fake_flashinfer.make_module(**options)` as `flashinfer`, with CUDA "available",
    so that `FlashInferBackend()` goes through its real import and version check."""

    def install(**options: Any) -> ModuleType:
        module = fake_flashinfer.make_module(**options)
        monkeypatch.setitem(sys.modules, "flashinfer", module)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 16)
        return module

    return install


@pytest.fixture
def fake_fi(install_flashinfer: Callable[..., ModuleType]) -> ModuleType:
    """The fake `flashinfer` 0.7.2.post1, installed."""
    return install_flashinfer()
