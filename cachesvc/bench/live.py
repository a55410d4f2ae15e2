"""What the benches on live workers share: the model they load and the local Ray cluster they
start (their own, in their own process, as a user's run would)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def bench_model(model: str | None, tiny: bool, max_positions: int = 4096) -> Iterator[str]:
    """The path of the model to load: `model`, the default one (SmolLM2) when None, or with
    `tiny` a tiny random model written to a temporary folder for the run's length."""
    if not tiny:
        from workers.text.default_model import default_model_path

        yield model or str(default_model_path())
        return
    from workers.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-") as tmp:
        folder = Path(tmp) / "tiny-llama"
        yield str(write_tiny_model(folder, vocab_size=512, max_position_embeddings=max_positions))


@contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray cluster of this process's own, shut down on the way out."""
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
