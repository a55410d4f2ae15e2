"""Attention over a paged KV cache, and the registry of its backends.

`get_backend(name)` builds a fresh backend. Each registered factory imports its implementation
module only when called, so importing this package loads no backend, and flashinfer is imported
only when a FlashInfer backend is built (which raises without CUDA). The interface every backend
implements is `base.AttentionBackend`; `schemes.make_scheme_backend` wraps one for the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.attention.base import AttentionBackend

BackendFactory = Callable[[], "AttentionBackend"]


def _torch() -> AttentionBackend:
    from workers.attention.torch_backend import TorchBackend

    return TorchBackend()


def _flashinfer() -> AttentionBackend:
    from workers.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


_REGISTRY: dict[str, BackendFactory] = {"torch": _torch, "flashinfer": _flashinfer}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make a backend selectable by name; replaces a factory already registered under it."""
    _REGISTRY[name] = factory


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend by name; raises ValueError listing the known names.

    Building one can raise too: RuntimeError for "flashinfer" without CUDA or the package.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
