"""What the tests of a hand-off's holds (`HandoffHolds`) share: a tiny engine, a prompt of a few
full blocks, and that prompt computed and held for a pull."""

from __future__ import annotations

from pathlib import Path

from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.peer.holds import HandoffHolds
from workers.peer.stage import prompt_hashes
from workers.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
NUM_FULL = 6  # full blocks of the prompt (block size 4)


def holds_engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), block_size=4, num_blocks=64))


def handoff_prompt(seed: int) -> list[int]:
    """`NUM_FULL` full blocks and a partial one, different for each `seed`."""
    return [(seed * 31 + 7 * j) % 300 + 3 for j in range(NUM_FULL * 4 + 3)]


def hold(engine: Engine, holds: HandoffHolds, prompt: list[int], salt: str | None = None) -> None:
    """Expect `prompt` under `salt` for a pull, compute it, and pin it at the step's end."""
    holds.expect(prompt, prompt_hashes(engine, prompt, salt), salt)
    engine.generate([prompt], ONE_TOKEN, cache_salt=salt)
    holds.at_boundary(engine)
