"""The tiny-model builder: its folders load with `load_model` and give transformers' logits,
the same seed gives the same weights in every process, transformers is not needed to write
one, and its tokenizers hold what the tests that use them rely on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.loader import load_model
from workers.model.tiny import BpeTokenizer, WordTokenizer, write_tiny_model
from workers.text.tokenizer import Tokenizer

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "qwen2": {"architecture": "qwen2"},  # q/k/v biases
    "mistral": {"architecture": "mistral", "num_kv_heads": 1},
}
VOCAB = 96
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loads_and_matches_transformers(variant: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(tmp_path, vocab_size=VOCAB, seed=3, **VARIANTS[variant])
    config = load_model(folder).config
    assert config.architecture == VARIANTS[variant].get("architecture", "llama")
    assert config.tie_word_embeddings == VARIANTS[variant].get("tie_word_embeddings", False)
    assert config.sliding_window is None
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Every next-token log-probability after a shared prefix and items of several lengths.
    engine = Engine(EngineConfig(model=str(folder), block_size=4, num_blocks=64))
    prefix, items = _ids(13, 1), [_ids(n, 10 + n) for n in (1, 6, 21)]
    got = engine.score(prefix, items, list(range(VOCAB)))
    with torch.inference_mode():
        want = [hf(torch.tensor([prefix + it])).logits[0, -1].log_softmax(-1) for it in items]
    torch.testing.assert_close(torch.tensor(got), torch.stack(want), rtol=0, atol=1e-4)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_seed_decides_the_weights(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "a", seed=7)
    again = write_tiny_model(tmp_path / "b", seed=7)
    other = write_tiny_model(tmp_path / "c", seed=8)
    weights = [(f / "model.safetensors").read_bytes() for f in (first, again, other)]
    assert weights[0] == weights[1] != weights[2]
    prints = [load_model(f).fingerprint for f in (first, again, other)]
    assert prints[0] == prints[1] != prints[2]


def test_writes_without_transformers(tmp_path: Path) -> None:
    # The benchmarks write a tiny model where transformers (a test-only dependency) is absent.
    code = (
        "import sys; from pathlib import Path; "
        "from workers.model.tiny import BpeTokenizer, write_tiny_model; "
        f"write_tiny_model(Path({str(tmp_path)!r}), "
        "tokenizer=BpeTokenizer(['hello world'] * 4, ['<|im_end|>'], '<|im_end|>')); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_word_tokenizer_ids_decode_to_words_that_encode_back(tmp_path: Path) -> None:
    spec = WordTokenizer(
        words=("hello", "there"), special=(*SPECIAL, "[UNK]"), unk="[UNK]", eos="<|im_end|>"
    )
    tok = Tokenizer.from_path(write_tiny_model(tmp_path, vocab_size=40, tokenizer=spec))
    assert tok.encode("hello there nowhere") == [4, 5, 3]  # special tokens first, then words
    ordinary = [i for i in range(40) if i not in tok.all_special_ids]
    assert len(ordinary) == 40 - 4
    # Any reply the model writes re-encodes to the very tokens it generated.
    assert tok.encode(tok.decode(ordinary)) == ordinary
    assert tok.eos_token_ids[0] == 2


def test_bpe_tokenizer_round_trips_text_and_must_fit_the_model(tmp_path: Path) -> None:
    corpus = ["hello world, hello router", "the cache hit ratio goes up"] * 10
    spec = BpeTokenizer(corpus=corpus, special=SPECIAL, eos="<|im_end|>")
    tok = Tokenizer.from_path(write_tiny_model(tmp_path / "ok", vocab_size=320, tokenizer=spec))
    text = "<|im_start|>hello, unseen words é"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids[0] == tok.encode("<|im_end|>")[0]
    with pytest.raises(ValueError, match="over 200"):
        write_tiny_model(tmp_path / "small", vocab_size=200, tokenizer=spec)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="architecture must be one of"):
        write_tiny_model(tmp_path, architecture="gpt2")
