"""Open a Hugging Face model folder: config.json plus one or many *.safetensors files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from workers.model.config import ModelConfig, ModelLoadError
from workers.model.weights import WeightSource

# Sampled from each file's data for the identity digest: enough to tell two checkpoints of the
# same shape apart, small enough to hash in milliseconds.
_SAMPLE_BYTES = 1 << 20


def open_hf_folder(folder: Path) -> WeightSource:
    """Read config.json and the safetensors headers; tensors are read later, one at a time.

    Raises ModelLoadError when config.json or the weights are missing or unreadable.
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder: no config.json")
    try:
        config_json = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {config_path}: {err}") from err
    config = ModelConfig.from_hf_dict(config_json)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} holds no *.safetensors weights")
    handles = {}
    location: dict[str, str] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as err:  # safetensors raises its own untyped errors
            raise ModelLoadError(f"cannot open {file}: {err}") from err
        handles[file.name] = handle
        location.update(dict.fromkeys(handle.keys(), file.name))

    def read(name: str) -> torch.Tensor:
        return handles[location[name]].get_tensor(name)

    return WeightSource(
        config=config,
        tensor_names=frozenset(location),
        read=read,
        identity=_identity(files),
    )


def _identity(files: list[Path]) -> bytes:
    """Digest of each file's name, size, header (names, dtypes, shapes) and sampled data."""
    digest = xxhash.xxh3_128()
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_len)
            head = f.read(_SAMPLE_BYTES)
            f.seek(max(8 + header_len, size - _SAMPLE_BYTES))
            tail = f.read(_SAMPLE_BYTES)
        for part in (file.name.encode(), struct.pack("<Q", size), header, head, tail):
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
    return digest.digest()
