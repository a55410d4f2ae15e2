"""A response-cache entry: the answer it holds, and its bytes, signed and checked.

Whoever can write to the store (a shared Redis) must not be able to answer a tenant's request:
every entry carries an HMAC-SHA256 over its cache key, its header and its payload, keyed from
the router's secret (`--response-cache-key-file`, or the deployment's tier key). An entry
that was forged, damaged, or copied from another key's name (an answer for another prompt or
another tenant) fails the tag; one that passes is still checked against the request before it
is served: as many samples as the request asks for, token ids in the model's vocabulary,
every field of the type it should have. Whatever fails is a miss, never an error.

    "CSRC" | version (1 byte) | tag (32 bytes) | JSON payload
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import struct
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.protocol import StreamDelta, Usage

_MAGIC = b"CSRC"
_VERSION = 2  # 1 had an unkeyed checksum: such entries are refused, not trusted
_HEADER = struct.Struct("<4sB")
_TAG_SIZE = 32
_KEY_CONTEXT = b"cachesvc response cache mac v1"  # never the KV blocks' key: another purpose
FINISHED = ("stop", "length")


@dataclass(frozen=True)
class CachedSample:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class CachedResponse:
    """A complete answer: one entry per sample, in sample order."""

    samples: tuple[CachedSample, ...]

    def deltas(self, ttft_ms: float) -> list[StreamDelta]:
        """The answer as a stream: one final delta per sample; its usage says where it came
        from (no prompt token computed or fetched, no worker)."""
        out = []
        for index, sample in enumerate(self.samples):
            usage = dataclasses.replace(
                sample.usage,
                cached_tokens={},
                computed_tokens=0,
                cache_write_tokens=0,
                ttft_ms=ttft_ms,
                decode_tokens_per_s=None,
                worker_id="",
                from_response_cache=True,
            )
            delta = StreamDelta(index, sample.token_ids, sample.text, sample.finish_reason, usage)
            out.append(delta)
        return out

    def min_encoded_size(self) -> int:
        """A lower bound of the payload's size, without encoding it: each token id takes at
        least two bytes of JSON (a digit and a comma), each character of text at least one."""
        return sum(2 * len(s.token_ids) + len(s.text) for s in self.samples)


@dataclass(frozen=True)
class EntryShape:
    """What the request that reads an entry expects of it."""

    num_samples: int
    vocab_size: int


class EntryCodec:
    """Signs entries with, and only believes entries signed with, one secret. Stateless apart
    from the key: safe to share."""

    def __init__(self, secret: bytes) -> None:
        mac_key = hmac.digest(secret, _KEY_CONTEXT, "sha256")
        self._mac = hmac.new(mac_key, digestmod="sha256")

    def encode(self, key: bytes, response: CachedResponse) -> bytes:
        """The bytes of `response` stored under the cache key `key`."""
        payload = json.dumps(
            [
                [list(s.token_ids), s.text, s.finish_reason, dataclasses.asdict(s.usage)]
                for s in response.samples
            ],
            separators=(",", ":"),
        ).encode()
        header = _HEADER.pack(_MAGIC, _VERSION)
        return header + self._tag(key, header, payload) + payload

    def decode(self, key: bytes, blob: bytes, shape: EntryShape) -> CachedResponse | None:
        """The answer in `blob` if it was signed for `key` and fits `shape`; None otherwise."""
        start = _HEADER.size + _TAG_SIZE
        if len(blob) < start:
            return None
        header, tag, payload = blob[: _HEADER.size], blob[_HEADER.size : start], blob[start:]
        if header != _HEADER.pack(_MAGIC, _VERSION):
            return None
        if not hmac.compare_digest(tag, self._tag(key, header, payload)):
            return None
        try:
            samples = json.loads(payload)
        except ValueError:
            return None
        return _response(samples, shape)

    def _tag(self, key: bytes, header: bytes, payload: bytes) -> bytes:
        mac = self._mac.copy()
        # The key's length first: no (key, payload) split of the same bytes signs alike.
        mac.update(struct.pack("<I", len(key)))
        for part in (key, header, payload):
            mac.update(part)
        return mac.digest()


def _response(samples: Any, shape: EntryShape) -> CachedResponse | None:
    """The answer a decoded payload holds, if every part has the type and range it should."""
    if not isinstance(samples, list) or len(samples) != shape.num_samples:
        return None
    out = []
    for sample in samples:
        if not isinstance(sample, list) or len(sample) != 4:
            return None
        ids, text, reason, usage = sample
        if not _token_ids(ids, shape.vocab_size):
            return None
        if not isinstance(text, str) or reason not in FINISHED or not _usage(usage):
            return None
        out.append(CachedSample(tuple(ids), text, reason, Usage(**usage)))
    return CachedResponse(tuple(out))


def _token_ids(ids: Any, vocab_size: int) -> bool:
    # `type(i) is int`: JSON's true and false are no token ids.
    return isinstance(ids, list) and all(type(i) is int and 0 <= i < vocab_size for i in ids)


_USAGE_TYPES = typing.get_type_hints(Usage)


def _usage(value: Any) -> bool:
    """Whether `value` holds a Usage's fields, each of its declared type (unknown fields and
    missing required ones are not)."""
    if not isinstance(value, dict) or not set(value) <= set(_USAGE_TYPES):
        return False
    required = {f.name for f in dataclasses.fields(Usage) if f.default is dataclasses.MISSING}
    if not required <= set(value):
        return False
    return all(_has_type(v, _USAGE_TYPES[k]) for k, v in value.items())


def _has_type(value: Any, hint: Any) -> bool:
    """`value` as JSON decodes it against a Usage field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in typing.get_args(hint))
    if origin is not None and issubclass(origin, Mapping):
        key_type, value_type = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _has_type(k, key_type) and _has_type(v, value_type) for k, v in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is float:  # JSON writes 5.0 back as 5.0, but a hand-made entry may say 5
        return type(value) in (int, float)
    if hint in (int, str, bool):
        return type(value) is hint
    return False  # a type this check does not know: refuse rather than trust
