"""What the engine's fault tests share: a batch of innocent requests of every kind (greedy,
seeded, samples, beams) and a bad one, the engine they run on, and running it to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.engine.outputs import RequestOutput
from workers.sampling_params import SamplingParams

BAD = "bad"
# Innocent requests of every kind, in one batch with the bad one.
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
SAMPLES = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=2, ignore_eos=True)
BEAMS = SamplingParams(max_tokens=8, beam_width=2, temperature=0.0, ignore_eos=True)
INNOCENT = [("greedy", GREEDY), ("seeded", SEEDED), ("samples", SAMPLES), ("beams", BEAMS)]


class InjectedError(RuntimeError):
    pass


def fault_prompts(low: int) -> dict[str, list[int]]:
    """A prompt per innocent request and for `BAD`, of random ids from `low` to 319 (seeded:
    the same on every call)."""

    def prompt(n: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(low, 320, (n,), generator=gen).tolist()

    return {name: prompt(9 + 3 * i, i) for i, name in enumerate([*dict(INNOCENT), BAD])}


def fault_engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), block_size=4, num_blocks=128))


def run_to_end(engine: Engine) -> dict[str, RequestOutput]:
    """Step until nothing is left; each request's final output (none comes after it)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in final, "an output after the request finished"
            if out.finished:
                final[out.request_id] = out
    return final


def add_innocent(engine: Engine, prompts: dict[str, list[int]]) -> None:
    for name, params in INNOCENT:
        engine.add_request(prompts[name], params, request_id=name)


def check_idle(engine: Engine) -> None:
    """Nothing is left on the engine's books and every block is free."""
    assert not engine.has_unfinished()
    assert not engine._requests and not engine._tracked and not engine._fork_plans
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def serve(engine: Engine, body: Callable[[AsyncEngine], Any]) -> Any:
    """`body` run over an AsyncEngine of `engine`, shut down after it."""

    async def main() -> Any:
        aengine = AsyncEngine(engine)
        try:
            return await body(aengine)
        finally:
            await aengine.shutdown()

    return asyncio.run(main())
