"""A small blocking client of the router, used by `cachesvc generate|chat|score --server` and
`cachesvc cache`.

Prints the same objects as offline `generate --json`, plus the worker that served each; the
cache calls answer JSON-ready dicts of their replies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc


class RemoteError(RuntimeError):
    """The server refused or failed a call; the message has the status code and its text."""


@dataclass(frozen=True)
class RemoteSampling:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    n: int
    ignore_eos: bool
    beam_width: int = 1

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop=list(self.stop),
            n=self.n,
            ignore_eos=self.ignore_eos,
            beam_width=self.beam_width,
        )
        if self.seed is not None:
            msg.seed = self.seed
        return msg


def make_prompt(text: str, chat: bool, system: str | None) -> pb.Prompt:
    if not chat:
        return pb.Prompt(text=text)
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    messages.append(pb.ChatMessage(role="user", content=text))
    return pb.Prompt(chat=pb.ChatMessages(messages=messages))


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes for a TLS channel: the CA that signed the router's certificate (None: the
    system's roots) and, for a router that requires them, this client's certificate and key."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)


class RouterClient:
    """Blocking calls to one router, over TLS when `tls` is given; use as a context manager."""

    def __init__(
        self, address: str, auth_token: str | None = None, tls: ClientTls | None = None
    ) -> None:
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.root_ca,
                private_key=tls.private_key,
                certificate_chain=tls.cert_chain,
            )
            self._channel = grpc.secure_channel(address, credentials)
        self._metadata = [("authorization", f"Bearer {auth_token}")] if auth_token else []
        self.inference = pb_grpc.InferenceStub(self._channel)
        self.cache = pb_grpc.CacheStub(self._channel)
        self.admin = pb_grpc.AdminStub(self._channel)

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def generate(
        self,
        text: str,
        sampling: RemoteSampling,
        *,
        chat: bool = False,
        system: str | None = None,
        cache_salt: str | None = None,
    ) -> list[dict[str, Any]]:
        """One JSON-ready dict per sample, in sample order."""
        return self._generate(make_prompt(text, chat, system), text, sampling, cache_salt)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        sampling: RemoteSampling,
        *,
        cache_salt: str | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> list[dict[str, Any]]:
        """The assistant's reply to `messages` ({"role", "content"} each, oldest first), one
        JSON-ready dict per sample; the server appends the template's assistant header.
        `on_text` gets the first sample's text piece by piece as it streams in."""
        turns = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        prompt = pb.Prompt(chat=pb.ChatMessages(messages=turns))
        return self._generate(prompt, "", sampling, cache_salt, on_text)

    def score(
        self,
        prefix: str,
        items: Sequence[str],
        label_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
    ) -> list[list[float]]:
        """Per item, in order, the log-probs of `label_token_ids` after `prefix + item`; the
        server encodes the prefix as a prompt and each item as its continuation, as offline."""
        request = pb.ScoreRequest(
            prefix=pb.Prompt(text=prefix),
            items=[pb.Prompt(text=item) for item in items],
            label_token_ids=list(label_token_ids),
        )
        if cache_salt is not None:
            request.cache_salt = cache_salt
        try:
            reply = self.inference.Score(request, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _remote_error(exc) from exc
        return [list(row.logprobs) for row in reply.scores]

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` as it would follow other text: the server's tokenizer without
        the bos/eos it adds to a prompt (how offline `score` encodes items and labels)."""
        if not text:
            return []  # Tokenize refuses empty text; it has no tokens either way
        request = pb.TokenizeRequest(prompt=pb.Prompt(text=text), continuation=True)
        try:
            return list(self.inference.Tokenize(request, metadata=self._metadata).token_ids)
        except grpc.RpcError as exc:
            raise _remote_error(exc) from exc

    def prewarm(
        self,
        prompt: pb.Prompt,
        *,
        retention_s: int | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """Cache.Prewarm: compute and keep `prompt`'s KV; what is cached, where."""
        request = pb.PrewarmRequest(prompt=prompt)
        if retention_s is not None:
            request.retention_s = retention_s
        if session_id is not None:
            request.session_id = session_id
        if cache_salt is not None:
            request.cache_salt = cache_salt
        return _as_dict(self._call(self.cache.Prewarm, request))

    def close_session(self, session_id: str) -> int:
        """Cache.CloseSession: blocks released, summed over the workers."""
        reply = self._call(self.cache.CloseSession, pb.CloseSessionRequest(session_id=session_id))
        return int(reply.num_blocks_released)

    def set_tenant_quota(
        self, tenant: str, share: float, max_retention_s: int, retention_share: float
    ) -> dict[str, Any]:
        """Admin.SetTenantQuota (the operator's token): the quota as it now applies."""
        quota = pb.TenantQuota(
            tenant=tenant,
            share=share,
            max_retention_s=max_retention_s,
            retention_share=retention_share,
        )
        reply = self._call(self.admin.SetTenantQuota, pb.SetTenantQuotaRequest(quota=quota))
        return _as_dict(reply.quota)

    def tenant_usage(self) -> list[dict[str, Any]]:
        """Admin.TenantUsage (the operator's token): per tenant, its quota and tiers' blocks."""
        reply = self._call(self.admin.TenantUsage, pb.TenantUsageRequest())
        return [
            {
                "quota": _as_dict(entry.quota),
                "tiers": {tier: _as_dict(u) for tier, u in sorted(entry.tiers.items())},
            }
            for entry in reply.tenants
        ]

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _remote_error(exc) from exc

    def _generate(
        self,
        prompt: pb.Prompt,
        text: str,
        sampling: RemoteSampling,
        cache_salt: str | None,
        on_text: Callable[[str], None] | None = None,
    ) -> list[dict[str, Any]]:
        try:
            ids = self.inference.Tokenize(
                pb.TokenizeRequest(prompt=prompt), metadata=self._metadata
            )
            request = pb.GenerateRequest(prompt=prompt, sampling=sampling.to_proto())
            if cache_salt is not None:
                request.cache_salt = cache_salt
            stream = self.inference.Generate(request, metadata=self._metadata)
            # Offline `generate --json` reports the prompt as the model saw it (templated).
            return _collect(ids.text or text, list(ids.token_ids), stream, sampling.n, on_text)
        except grpc.RpcError as exc:
            raise _remote_error(exc) from exc


def _as_dict(message: Any) -> dict[str, Any]:
    """A reply's fields by name, every field present (zeros and empty strings included)."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def _remote_error(exc: grpc.RpcError) -> RemoteError:
    return RemoteError(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]


def _collect(
    prompt: str,
    prompt_ids: list[int],
    stream: Any,
    n: int,
    on_text: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    samples = [_empty(prompt, prompt_ids) for _ in range(n)]
    for msg in stream:
        sample = samples[msg.index]
        if on_text is not None and msg.index == 0 and msg.text:
            on_text(msg.text)
        sample["request_id"] = msg.request_id if n == 1 else f"{msg.request_id}-{msg.index}"
        sample["token_ids"].extend(msg.token_ids)
        sample["text"] += msg.text
        if msg.finish_reason:
            sample["finish_reason"] = msg.finish_reason
        if msg.HasField("usage"):
            _apply_usage(sample, msg.usage)
    return samples


def _empty(prompt: str, prompt_ids: Sequence[int]) -> dict[str, Any]:
    return {
        "request_id": "",
        "prompt": prompt,
        "prompt_token_ids": list(prompt_ids),
        "token_ids": [],
        "text": "",
        "finish_reason": None,
        "ttft_ms": None,
        "decode_tokens_per_s": None,
        "cached_tokens": 0,
        "cached_tokens_by_tier": {},
        "computed_tokens": 0,
        "cache_write_tokens": 0,
        "worker_id": None,
    }


def _apply_usage(sample: dict[str, Any], usage: pb.Usage) -> None:
    sample["ttft_ms"] = usage.ttft_ms
    sample["decode_tokens_per_s"] = usage.decode_tokens_per_s or None
    sample["cached_tokens"] = sum(usage.cached_tokens.values())
    sample["cached_tokens_by_tier"] = {k: v for k, v in usage.cached_tokens.items() if v}
    sample["computed_tokens"] = usage.computed_tokens
    sample["cache_write_tokens"] = usage.cache_write_tokens
    sample["worker_id"] = usage.worker_id
    if usage.prefill_worker_id:  # handed off: where the prompt was computed, the KV moved
        sample["prefill_worker_id"] = usage.prefill_worker_id
        sample["kv_transfer_tokens"] = usage.kv_transfer_tokens
