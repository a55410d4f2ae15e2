"""Per-request sampling parameters, validated at construction.

Both doors (gRPC, HTTP) and the worker build a `SamplingParams` from what a client sent, so this
is the one place a sampling number is checked: whatever it accepts, the engine's arithmetic
survives (float32 sampling, beam scores), and a refusal is a ValueError whose message starts with
the field's name (the doors answer it as INVALID_ARGUMENT / 400 naming that field).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

MAX_N = 64
MAX_BEAM_WIDTH = 32
MAX_TOKENS = 2**31 - 1  # the gRPC wire's int32; the context cuts any answer far sooner
# Hugging Face's length penalty is a small exponent (0.6 .. 2 in practice); past this bound the
# length alone decides the ranking, and a finite bound keeps `len ** penalty` tame.
MAX_LENGTH_PENALTY = 100.0
# As vLLM: a temperature below this samples greedily. Dividing float32 logits by it would send
# all but the largest to -inf anyway, and one that rounds to 0 in float32 would give 0 / 0.
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_END = -(2**63), 2**64  # int64 from the doors; a sample's seed wraps in uint64
MAX_OUTPUT_OFFSET = 2**63 - 1  # plus an output index, it must fit the draw's uint64 key


def _integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _float32(value: float) -> float:
    """`value` as the sampler sees it (float32 tensors)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; the same defaults as vLLM where they overlap.

    `temperature == 0` is greedy, and so is any temperature below `GREEDY_BELOW` (it is stored
    as 0). `top_k <= 0` and `top_p == 1` switch those filters off; a `top_p` that is 0 in float32
    is refused. With a `seed`, sampling is reproducible per request whatever else shares the
    batch. `n` asks for that many independent samples of one prompt (sample i uses `seed + i`,
    modulo 2**64). The seeded draw of output token k depends only on (seed, `output_offset` + k):
    a stream resumed on another worker with the tokens already sent as prompt and `output_offset`
    set to their count draws the same tokens as the undisturbed stream would have.
    Raises ValueError whose message starts with the offending field's name.
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
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        self._check_numbers()
        _integer("top_k", self.top_k, -1, 2**63 - 1)  # -1 or 0: off (vLLM's -1)
        if self.seed is not None:
            _integer("seed", self.seed, SEED_MIN, SEED_END - 1)
        _integer("n", self.n, 1, MAX_N)
        _integer("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        if self.beam_width > 1 and self.n != 1:
            raise ValueError("n must be 1 with beam search (beam_width > 1)")
        _integer("output_offset", self.output_offset, 0, MAX_OUTPUT_OFFSET)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, 2**63 - 1)
        # Normalise list arguments so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def _check_numbers(self) -> None:
        temperature = _finite("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature:g}")
        object.__setattr__(self, "temperature", 0.0 if temperature < GREEDY_BELOW else temperature)
        top_p = _finite("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p:g}")
        if _float32(top_p) == 0:
            raise ValueError(f"top_p must be at least 1.4e-45 (0 in float32), got {top_p:g}")
        penalty = _finite("length_penalty", self.length_penalty)
        if abs(penalty) > MAX_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {penalty:g}"
            )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an `n`-sample request: n = 1 and its own seed
        (`seed + index`, modulo 2**64: the draws key on the seed modulo 2**64 anyway), so each
        sample is reproducible alone (and resumable alone)."""
        seed = None if self.seed is None else (self.seed + index) % SEED_END
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
