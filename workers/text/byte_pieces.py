"""Each token's bytes, for tokenizers whose decoder is byte-level (GPT-2, Llama 3, Qwen2,
SmolLM2): their text of any ids is the UTF-8 of the ids' bytes joined, so a stream of tokens can
be decoded by appending bytes, without asking the tokenizer to decode a window twice a token.

`byte_pieces` builds the table and checks it against the tokenizer's own decode of every single
id; any other decoder, or any id that disagrees, gives None and the caller decodes as before.
"""

from __future__ import annotations

from collections.abc import Collection

from tokenizers import Tokenizer as Backend
from tokenizers import decoders


def _byte_spelling() -> list[str]:
    """GPT-2's printable character for each byte value, indexed by byte (`bytes_to_unicode`):
    the printable bytes stand for themselves, the other 68 for the code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return [spelling[b] for b in range(256)]


BYTE_SPELLING = _byte_spelling()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_SPELLING)}


def byte_pieces(backend: Backend, special_ids: Collection[int]) -> tuple[bytes, ...] | None:
    """Token id -> the bytes it adds to a decoded text, special tokens adding none (as
    `decode(..., skip_special_tokens=True)` drops them); None unless the decoder is byte-level
    and every id's bytes decode to what the tokenizer decodes that id to."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    alphabet = _CHAR_TO_BYTE
    special = set(special_ids)
    pieces: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id)
        if token is None or token_id in special:
            pieces.append(b"")
        elif all(c in alphabet for c in token):
            pieces.append(bytes(alphabet[c] for c in token))
        else:  # an added token spelled in plain text: its own UTF-8
            pieces.append(token.encode())
    texts = backend.decode_batch([[i] for i in range(len(pieces))], skip_special_tokens=True)
    if any(p.decode(errors="replace") != t for p, t in zip(pieces, texts, strict=True)):
        return None
    return tuple(pieces)
