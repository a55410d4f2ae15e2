"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_N = 64
MAX_BEAM_WIDTH = 32


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; the same defaults as vLLM where they overlap.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` switch those filters off. With a
    `seed`, sampling is reproducible per request whatever else shares the batch. `n` asks for that
    many independent samples of one prompt (sample i uses `seed + i`). The seeded draw of output
    token k depends only on (seed, `output_offset` + k): a stream resumed on another worker with
    the tokens already sent as prompt and `output_offset` set to their count draws the same
    tokens as the undisturbed stream would have.
    Raises ValueError naming the offending field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    output_offset: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.beam_width > 1 and self.n != 1:
            raise ValueError("n must be 1 with beam search (beam_width > 1)")
        if self.output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {self.output_offset}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Normalise list arguments so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an `n`-sample request: n = 1 and its own seed
        (`seed + index`), so each sample is reproducible alone (and resumable alone)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
