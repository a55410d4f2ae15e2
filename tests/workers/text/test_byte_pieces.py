"""The detokenizer's byte-level path (`workers.text.byte_pieces`) against the tokenizer's own
decode of windows: the same deltas, token by token, on the model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from workers.text.default_model import default_model_path
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


@pytest.fixture(scope="module")
def partial_utf8_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 alone: the pieces of multi-byte characters."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]


def test_the_models_tokenizer_has_byte_pieces_that_spell_each_token(tokenizer: Tokenizer) -> None:
    pieces = tokenizer.byte_pieces
    assert pieces is not None and len(pieces) == tokenizer.vocab_size
    assert all(pieces[i] == b"" for i in tokenizer.all_special_ids)
    # "猫" is three bytes; the tokens that spell it carry them, and only joined are they text.
    ids = tokenizer.encode("猫 🐱", add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids).decode() == "猫 🐱"


def _deltas(tok: Tokenizer, ids: list[int], *, byte_level: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, byte_level=byte_level)
    return [detok.add(i) for i in ids] + [detok.finish()]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_byte_path_gives_the_window_paths_deltas(
    tokenizer: Tokenizer, partial_utf8_ids: list[int], data: st.DataObject
) -> None:
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    special = st.sampled_from(tokenizer.all_special_ids)
    pieces = st.sampled_from(partial_utf8_ids)
    ids = data.draw(st.lists(st.one_of(pieces, any_id, special), max_size=40))
    assert _deltas(tokenizer, ids, byte_level=True) == _deltas(tokenizer, ids, byte_level=False)


def test_an_id_outside_the_vocabulary_is_a_tokenizer_error(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        detok.add(tokenizer.vocab_size)


def test_a_decoder_that_is_not_byte_level_has_no_pieces(tmp_path: Path) -> None:
    # WordPiece joins with spaces and glues "##" pieces: no per-token bytes spell that.
    backend = Backend(models.WordPiece({"[UNK]": 0, "hello": 1, "##s": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_path(tmp_path)
    assert tok.byte_pieces is None
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(1), detok.add(2), detok.add(1)] == ["hello", "s", " hello"]
