"""`cachesvc bench kv-codec`: what each tier codec saves and what it changes, on a model's own KV.

* size and speed: the KV of the prompts' prefixes encoded in each mode, as float32 and as
  bfloat16: bytes per token against raw, encode and decode GB/s of KV (one thread: numpy and
  lz4), and the KV's relative RMS error after a round trip.
* logits: each prompt's prefix (its whole blocks, short of the last token) is computed once;
  its KV goes through the codec and back into the same device blocks; then the rest of the
  prompt and the 63 tokens that raw KV generates after it (teacher forcing) are computed on top.
  Max and mean |logit - raw logit| over those positions, and the share whose argmax changes.
* greedy: end to end through a DRAM tier in the codec: the prompts computed once, evicted into
  the tier, then generated again with the plan forced to fetch; 64 greedy tokens against an
  engine without any cache. Prompts whose tokens all agree, the mean count of tokens before the
  first difference, and the share of positions that agree.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cachesvc.kv.codec import Codec
from cachesvc.kv.types import BlockHash, BlockId, RequestId
from cachesvc.workloads.table import format_table, write_json

MODES = ("raw", "shuffle_lz4", "int8", "fp8_e4m3")
BLOCK_SIZE = 16
SYSTEM = (
    "You are a careful assistant for a public library. Answer in plain English, in two or three "
    "sentences, using only the passage the reader gives you. If the passage does not say, reply "
    "that it does not say and suggest where in the library the reader could look instead. Do not "
    "invent names, dates or numbers, and keep a friendly, patient tone.\n\n"
)
# Each a passage and a question about it.
PASSAGES = (
    "Honey bees tell the direction of flowers with a waggle dance.|How do bees share food sites?",
    "Roman aqueducts carried water across valleys on stone arches.|How did Romans move water?",
    "Octopuses have three hearts and blue blood rich in copper.|Why is octopus blood blue?",
    "The printing press spread cheap books across Europe after 1450.|What changed after 1450?",
    "Volcanic ash grounds aircraft because it melts inside jet engines.|Why do planes avoid ash?",
    "Sourdough rises thanks to wild yeast and lactic acid bacteria.|What makes sourdough rise?",
    "The Great Barrier Reef is visible from low Earth orbit.|Can the reef be seen from space?",
    "Penguins huddle in turns so each bird gets time in the middle.|How do penguins stay warm?",
    "A leap year adds a day to keep the calendar in step with the seasons.|Why leap years?",
    "Copper roofs turn green as a patina of carbonates forms on them.|Why are old roofs green?",
    "Tea was first drunk in China as a medicine, long before a daily drink.|How did tea start?",
    "Lighthouses used rotating lenses to throw a beam miles out to sea.|How did lighthouses work?",
    "Glaciers carve U-shaped valleys as they grind slowly downhill.|What shapes a glacial valley?",
    "Chess engines search millions of positions a second to pick a move.|How do chess bots play?",
    "The violin's body amplifies the vibration of its four strings.|Why is a violin loud?",
    "Monarch butterflies fly thousands of kilometers to Mexico each autumn.|Where do monarchs go?",
    "Bridges expand in summer heat, so engineers leave joints to let them move.|Why bridge gaps?",
    "Rainbows appear when sunlight is bent and reflected inside raindrops.|How do rainbows form?",
    "Ancient Egyptians wrote on papyrus made from reeds that grew by the Nile.|What was papyrus?",
    "Owls fly silently because their feathers have soft, comb-like edges.|Why are owls quiet?",
)


@dataclass(frozen=True)
class SizeRow:
    dtype: str
    mode: str
    bytes_per_token: float
    vs_raw: float  # raw bytes over this mode's
    encode_gb_s: float
    decode_gb_s: float
    rel_rms_error: float


@dataclass(frozen=True)
class QualityRow:
    mode: str
    max_logit_error: float
    mean_logit_error: float
    argmax_changed: float  # share of positions
    identical_prompts: int
    num_prompts: int
    mean_tokens_before_difference: float
    positions_agreeing: float  # share
    cached_tokens: int  # prompt tokens the greedy run did not compute (all from the tier)


def _greedy(num_tokens: int) -> Any:
    from workers.sampling_params import SamplingParams

    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


def _forward(runner: Any, seq: list[int], start: int, end: int, rows: list[int]) -> Any:
    """Compute tokens [start, end) of `seq` over scratch blocks 0.. (their KV before `start`
    already written); the float32 logits of `rows` (offsets in the chunk)."""
    from workers.engine.scheduler import ScheduledChunk
    from workers.engine.scheme_plan import plan_step

    ids = tuple(BlockId(i) for i in range(-(-end // BLOCK_SIZE)))
    chunk = ScheduledChunk(RequestId("kv-codec"), tuple(seq[start:end]), start, ids, sample=False)
    plan = plan_step((chunk,), BLOCK_SIZE, "naive", "torch")
    return runner.forward_layout(chunk.token_ids, range(start, end), plan.layout, rows)


@dataclass
class _LogitError:
    max: float = 0.0
    total: float = 0.0
    num_values: int = 0
    num_changed: int = 0
    num_rows: int = 0

    def add(self, logits: Any, base: Any) -> None:
        diff = (logits - base).abs()
        self.max = max(self.max, float(diff.max()))
        self.total += float(diff.sum())
        self.num_values += diff.numel()
        self.num_changed += int((logits.argmax(-1) != base.argmax(-1)).sum())
        self.num_rows += len(base)


def _logit_errors(
    engine: Any, prompts: list[list[int]], continuations: list[list[int]]
) -> tuple[dict[str, _LogitError], list[np.ndarray]]:
    """Per mode, the logits' error against raw KV's over every prompt; and the prefixes' KV."""
    from workers.engine.kv_copy import read_block, write_blocks

    runner, caches, dtype = engine.runner, engine.runner.kv_caches, engine.config.dtype
    errors = {m: _LogitError() for m in MODES}
    kv: list[np.ndarray] = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        seq = prompt + continuation[:-1]
        prefix = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        _forward(runner, seq, 0, prefix, [prefix - 1])
        ids = [BlockId(i) for i in range(prefix // BLOCK_SIZE)]
        raw = [read_block(caches, i) for i in ids]
        kv.extend(raw)
        rows = list(range(len(seq) - prefix))
        base = _forward(runner, seq, prefix, len(seq), rows)
        for mode in MODES:
            codec = Codec("00" * 16, mode)
            write_blocks(caches, ids, [_round_trip(codec, dtype, a) for a in raw], dtype)
            errors[mode].add(_forward(runner, seq, prefix, len(seq), rows), base)
    return errors, kv


def _round_trip(codec: Codec, dtype: str, array: np.ndarray) -> np.ndarray:
    block_hash = BlockHash(bytes(16))
    block = codec.decode(codec.encode(block_hash, None, dtype, array), block_hash)
    assert block is not None
    return block.array


def _size_rows(kv: list[np.ndarray]) -> list[SizeRow]:
    """Each mode on float32 `kv` blocks, as float32 and as bfloat16."""
    import torch

    from workers.engine.kv_copy import kv_to_numpy

    rows = []
    hashes = [BlockHash(i.to_bytes(16, "little")) for i in range(len(kv))]
    num_tokens = len(kv) * BLOCK_SIZE
    for dtype in ("float32", "bfloat16"):
        arrays = [kv_to_numpy(torch.from_numpy(a).to(getattr(torch, dtype))) for a in kv]
        exact = [torch.from_numpy(a).double() for a in kv]
        raw_bytes = sum(a.nbytes for a in arrays)
        raw_size = sum(
            len(Codec("00" * 16).encode(h, None, dtype, a))
            for h, a in zip(hashes, arrays, strict=True)
        )
        for mode in MODES:
            codec = Codec("00" * 16, mode)
            start = time.perf_counter()
            blobs = [codec.encode(h, None, dtype, a) for h, a in zip(hashes, arrays, strict=True)]
            encode_s = time.perf_counter() - start
            start = time.perf_counter()
            decoded = [codec.decode(b, h) for h, b in zip(hashes, blobs, strict=True)]
            decode_s = time.perf_counter() - start
            err = sq = 0.0
            for block, ref in zip(decoded, exact, strict=True):
                assert block is not None
                got = _as_float64(block.array, dtype)
                err += float(((got - ref) ** 2).sum())
                sq += float((ref**2).sum())
            size = sum(len(b) for b in blobs)
            rows.append(
                SizeRow(
                    dtype,
                    mode,
                    size / num_tokens,
                    raw_size / size,
                    raw_bytes / encode_s / 1e9,
                    raw_bytes / decode_s / 1e9,
                    (err / sq) ** 0.5,
                )
            )
    return rows


def _as_float64(array: np.ndarray, dtype: str) -> Any:
    import torch

    tensor = torch.from_numpy(array)
    if dtype == "bfloat16":
        tensor = tensor.view(torch.int16).view(torch.bfloat16)
    return tensor.double()


def _greedy_tier(
    loaded: Any, prompts: list[list[int]], expected: list[list[int]], mode: str
) -> tuple[list[list[int]], int]:
    """Greedy tokens with every prompt's prefix fetched from a DRAM tier in `mode`, and how many
    prompt tokens were cached: fetched from the tier, or found on the device where another
    prompt's fetch of the shared instructions had landed them."""
    from cachesvc.kv.config import TierConfig
    from workers.config import EngineConfig
    from workers.engine.engine import Engine

    num_tokens = len(expected[0])
    num_blocks = sum(-(-(len(p) + num_tokens) // BLOCK_SIZE) + 1 for p in prompts)
    tiers = TierConfig(dram_mb=num_blocks + 16, dram_codec=mode, plan="fetch", calibrate=False)
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, tiers=tiers)
    engine = Engine(config, loaded=loaded)
    try:
        engine.generate(prompts, _greedy(1))
        engine.pool.reset_cache()  # every prompt block leaves the device into the tier
        outputs = engine.generate(prompts, _greedy(num_tokens))
    finally:
        engine.close()
    cached = sum(out.num_cached_tokens for out in outputs)
    return [list(out.token_ids) for out in outputs], cached


def _agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[int, float, float]:
    """Sequences identical, mean tokens before the first difference, share of equal positions."""
    before, equal = [], 0
    for want, have in zip(expected, got, strict=True):
        diffs = [i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b]
        before.append(diffs[0] if diffs else len(want))
        equal += len(want) - len(diffs)
    identical = sum(n == len(w) for n, w in zip(before, expected, strict=True))
    return identical, sum(before) / len(before), equal / sum(len(w) for w in expected)


def run_kv_codec_bench(
    model: str | None, quick: bool, json_path: str | None, threads: int | None = None
) -> int:
    """Print the tables (and write JSON); returns the process exit status."""
    import torch

    from workers.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    num_prompts, num_tokens = (5, 16) if quick else (len(PASSAGES), 64)
    loaded = load_model(model)
    # No prefix cache: the reference, and scratch blocks the logit runs may overwrite.
    plain = Engine(EngineConfig(enable_prefix_caching=False, block_size=BLOCK_SIZE), loaded=loaded)
    pairs = [p.split("|") for p in PASSAGES[:num_prompts]]
    texts = [f"{SYSTEM}Passage: {p}\nQuestion: {q}\nAnswer:" for p, q in pairs]
    prompts = [plain.encode_prompt(t) for t in texts]
    expected = [list(out.token_ids) for out in plain.generate(prompts, _greedy(num_tokens))]
    errors, kv = _logit_errors(plain, prompts, expected)
    plain.close()
    sizes = _size_rows(kv)
    quality = []
    for mode in MODES:
        got, cached = _greedy_tier(loaded, prompts, expected, mode)
        identical, before, share = _agreement(expected, got)
        e = errors[mode]
        quality.append(
            QualityRow(
                mode,
                e.max,
                e.total / e.num_values,
                e.num_changed / e.num_rows,
                identical,
                len(prompts),
                before,
                share,
                cached,
            )
        )
        print(f"  {mode}: {identical}/{len(prompts)} identical, {cached} tokens cached", flush=True)
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(
        f"\nmodel {loaded.path.name}, {len(prompts)} prompts of {mean_len:.0f} tokens on average, "
        f"{num_tokens} greedy tokens, torch threads {torch.get_num_threads()}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"\nKV of the prefixes ({len(kv)} blocks of {BLOCK_SIZE} tokens), one thread")
    headers = ["dtype", "mode", "bytes/token", "x smaller", "encode GB/s", "decode GB/s"]
    print(
        format_table(
            [*headers, "rel. RMS error"],
            [
                [r.dtype, r.mode, f"{r.bytes_per_token:.0f}", r.vs_raw, r.encode_gb_s]
                + [r.decode_gb_s, f"{r.rel_rms_error:.2e}"]
                for r in sizes
            ],
        )
    )
    print(
        f"\nLogits against raw KV (float32; positions after the prefix), greedy over {num_tokens}"
    )
    headers = ["mode", "max |dlogit|", "mean |dlogit|", "argmax changed", "identical"]
    print(
        format_table(
            [*headers, "tokens before diff", "positions agree", "cached tokens"],
            [
                [q.mode, f"{q.max_logit_error:.3g}", f"{q.mean_logit_error:.3g}"]
                + [f"{q.argmax_changed:.1%}", f"{q.identical_prompts}/{q.num_prompts}"]
                + [q.mean_tokens_before_difference, f"{q.positions_agreeing:.1%}", q.cached_tokens]
                for q in quality
            ],
        )
    )
    write_json(
        json_path,
        {
            "suite": "kv-codec",
            "model": loaded.path.name,
            "quick": quick,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "duration_s": time.perf_counter() - start,
            "sizes": [asdict(r) for r in sizes],
            "quality": [asdict(q) for q in quality],
        },
    )
    return 0
