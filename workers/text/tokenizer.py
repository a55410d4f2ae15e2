"""Text to token ids and back for one model, plus its chat template.

`Tokenizer.from_path` reads either a GGUF file, rebuilding a Hugging Face `tokenizers` BPE from the
file's own metadata (the way llama.cpp would tokenize with it), or a Hugging Face folder with a
`tokenizer.json`. Either way one `tokenizers.Tokenizer` does the work; this class adds the model's
stop tokens and renders its chat template in a sandboxed jinja2 environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from workers.text.byte_pieces import BYTE_SPELLING as _BYTE_SPELLING
from workers.text.byte_pieces import byte_pieces


class TokenizerError(ValueError):
    """A tokenizer cannot be built from its files, or was given invalid input."""


# Used when a model ships no chat template; most small instruct models speak ChatML.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Special tokens that end a turn in common chat formats; like llama.cpp, generation stops on any
# of them that the vocabulary has, even when the metadata names another eos.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
)


@dataclass(frozen=True)
class _Parts:
    """What a model's files say about its tokenizer, before the stop tokens are worked out."""

    backend: Backend
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template and stop tokens. Immutable once built."""

    def __init__(self, parts: _Parts) -> None:
        """Use `from_path`; raises TokenizerError if a special id or the chat template is bad."""
        self._backend = parts.backend
        self._vocab_size = parts.backend.get_vocab_size(with_added_tokens=True)
        self._bos_token_id = parts.bos_token_id
        self._special_ids = tuple(
            sorted(i for i, t in parts.backend.get_added_tokens_decoder().items() if t.special)
        )
        self._eos_token_ids = _stop_token_ids(parts.backend, parts.eos_token_ids)
        for token_id in (parts.bos_token_id, *self._eos_token_ids):
            if token_id is not None and not 0 <= token_id < self._vocab_size:
                raise TokenizerError(f"special token id {token_id} is outside the vocabulary")
        self._chat_template = _compile_chat_template(parts.chat_template or _CHATML_TEMPLATE)
        self._max_token_chars = max(len(t) for t in parts.backend.get_vocab(True))

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Build from a `.gguf` file or a Hugging Face folder; raises TokenizerError if unusable."""
        path = Path(path)
        if path.is_dir():
            return cls(_read_hf_folder(path))
        if path.is_file() and path.suffix == ".gguf":
            return cls(_read_gguf(path))
        raise TokenizerError(
            f"tokenizer path {str(path)!r} is neither a .gguf file nor a Hugging Face folder"
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the model's eos first, then end-of-turn tokens it knows."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of special tokens (sorted): the ones `decode(skip_special_tokens=True)` drops."""
        return self._special_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") always
        become their single id; `add_special_tokens` only controls an added bos/eos."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        # The batch call releases the GIL while it works (the single one holds it): a long
        # text tokenized on a thread then leaves the caller's event loop running.
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry's
        spelling, never shorter than the text it decodes to (byte-level and SentencePiece
        vocabularies spell every byte or space; a tokenizer that drops whitespace can make a
        text longer than this bound suggests)."""
        return self._max_token_chars

    @cached_property
    def byte_pieces(self) -> tuple[bytes, ...] | None:
        """Each id's bytes where the decoder is byte-level (`workers.text.byte_pieces`)."""
        return byte_pieces(self._backend, self._special_ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence decodes to U+FFFD."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise TokenizerError(
                f"token id {bad} is outside the vocabulary [0, {self._vocab_size})"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ({"role", "content"} each) as the prompt text the model expects."""
        checked = [_check_message(i, m) for i, m in enumerate(messages)]
        try:
            return self._chat_template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self._bos_token_id),
                eos_token=self._token_text(self._eos_token_ids[0] if self._eos_token_ids else None),
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed to render: {e}") from e

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")


def _check_message(index: int, message: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise TokenizerError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise TokenizerError(f"messages[{index}].{key} must be a string")
    return dict(message)


def _stop_token_ids(backend: Backend, eos_ids: Iterable[int]) -> tuple[int, ...]:
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    turn_ends = (backend.token_to_id(t) for t in _END_OF_TURN_TOKENS if t in specials)
    # dict.fromkeys drops repeats but keeps the order: the model's own eos stays first.
    return tuple(dict.fromkeys(i for i in (*eos_ids, *turn_ends) if i is not None))


# --- chat template ------------------------------------------------------------------------------


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation (e.g. roles that do not alternate).
    raise TokenizerError(f"chat template rejected the messages: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# The same environment settings as transformers, so templates render identically.
_JINJA_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_JINJA_ENV.filters["tojson"] = _tojson
_JINJA_ENV.globals["raise_exception"] = _raise_exception
_JINJA_ENV.globals["strftime_now"] = _strftime_now


def _compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _JINJA_ENV.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e


# --- GGUF ---------------------------------------------------------------------------------------

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# tokenizer.ggml.pre values and how llama.cpp splits text for them before BPE.
_GPT2_SPLIT = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo"})
_DIGITS_THEN_GPT2_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _read_gguf(path: Path) -> _Parts:
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise TokenizerError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported: only byte-level BPE ('gpt2') is; "
            "load the model's Hugging Face folder instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise TokenizerError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    backend = _byte_level_backend(tokens, token_types, meta.get("tokenizer.ggml.merges") or [])
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    ids = {k: _gguf_token_id(meta, k, len(tokens)) for k in ("bos", "eos", "eot", "eom")}
    backend.post_processor = _bos_eos_processor(
        tokens,
        ids["bos"] if meta.get("tokenizer.ggml.add_bos_token", False) else None,
        ids["eos"] if meta.get("tokenizer.ggml.add_eos_token", False) else None,
    )
    eos_ids = tuple(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)
    return _Parts(backend, ids["bos"], eos_ids, meta.get("tokenizer.chat_template"))


def _gguf_token_id(meta: Mapping[str, Any], name: str, num_tokens: int) -> int | None:
    token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is not None and not 0 <= token_id < num_tokens:
        raise TokenizerError(f"GGUF {name}_token_id {token_id} is outside the vocabulary")
    return token_id


def _byte_level_backend(tokens: list[str], token_types: list[int], merges: list[str]) -> Backend:
    """A byte-level BPE whose ids are the GGUF's token indices."""
    added_types = (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    # BPE pieces must be spelled in the byte alphabet; llama.cpp stores a few raw, so respell
    # those. Added tokens keep their raw text: they are matched in the text whole, not by BPE.
    vocab = {
        tok if kind in added_types or set(tok) <= _BYTE_ALPHABET else _respell(tok): i
        for i, (tok, kind) in enumerate(zip(tokens, token_types, strict=True))
    }
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tok, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind in added_types
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerError("GGUF vocabulary has duplicate tokens; ids would not match the model")
    return backend


_BYTE_ALPHABET = frozenset(_BYTE_SPELLING)


def _respell(token: str) -> str:
    return "".join(_BYTE_SPELLING[b] for b in token.encode("utf-8"))


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_SPLIT:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_SPLIT:
        # llama.cpp isolates each digit before the GPT-2 split, as these models' tokenizer.json
        # does; it matters where spaces precede a digit: "  1" is "ĠĠ","1", not "Ġ","Ġ","1".
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre in _REGEX_SPLITS:
        split = pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    known = sorted(_GPT2_SPLIT | _DIGITS_THEN_GPT2_SPLIT | _REGEX_SPLITS.keys())
    raise TokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {known}")


def _bos_eos_processor(
    tokens: list[str], bos_id: int | None, eos_id: int | None
) -> processors.TemplateProcessing:
    specials = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos_id, eos_id) if x is not None)]
    head = [tokens[bos_id]] if bos_id is not None else []
    tail = [tokens[eos_id]] if eos_id is not None else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, "$B", *tail], special_tokens=specials
    )


# --- Hugging Face folder ------------------------------------------------------------------------


def _read_hf_folder(folder: Path) -> _Parts:
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{str(folder)!r} has no tokenizer.json; only fast (tokenizers) tokenizers are "
            "supported"
        )
    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"cannot parse {folder / 'tokenizer.json'}: {e}") from e
    config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    # bos/eos insertion is already in tokenizer.json's post-processor; only the ids are read here.
    bos_id = _token_id(backend, config.get("bos_token"))
    if bos_id is None:
        bos_id = model_config.get("bos_token_id")
    # The tokenizer's own eos first: templates render it as `eos_token`.
    eos_ids = [
        *_as_ids(_token_id(backend, config.get("eos_token"))),
        *_as_ids(generation.get("eos_token_id")),
        *_as_ids(model_config.get("eos_token_id")),
    ]
    return _Parts(backend, bos_id, tuple(eos_ids), _hf_chat_template(folder, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_id(backend: Backend, token: str | Mapping[str, Any] | None) -> int | None:
    # tokenizer_config.json spells a special token as its text or as an AddedToken dict.
    content = token.get("content") if isinstance(token, Mapping) else token
    return backend.token_to_id(content) if isinstance(content, str) else None


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template to its own file; older ones put it in the config,
    # sometimes as a list of named templates.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
