"""Proto messages <-> the router's own types; structural checks that name the wire field.

Only this module and `server.py` import the generated proto modules.
"""

from __future__ import annotations

import functools
import math

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.domain import (
    MAX_AFFINITY_KEY_LEN,
    ChatMessage,
    GenerateInput,
    InvalidInput,
    PrewarmInput,
    PrewarmResult,
    PromptInput,
    RouterStats,
    ScoreInput,
    ScoreResult,
    WorkerStatus,
)
from router.request.cache_hints import check_retention_s, check_session_id
from router.request.explain import explanation_of
from router.request.ids import MAX_ID_LEN, check_request_id
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams

_MAX_STOP_STRINGS = 16
# A Score answer is one message, and a gRPC client takes at most 4 MiB in one by default.
_MAX_ANSWER_BYTES = 4 * 2**20 - 2**10  # a margin for worker_id and the framing
_ITEM_BYTES = 10  # an ItemScores beside its log-probs: two tags, two lengths (varints)
_HEALTH = {
    "healthy": pb.WorkerInfo.HEALTHY,
    "unhealthy": pb.WorkerInfo.UNHEALTHY,
    "dead": pb.WorkerInfo.DEAD,
}


def prompt_from_proto(msg: pb.Prompt, field: str = "prompt") -> PromptInput:
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return PromptInput(text=msg.text)
    if kind == "token_ids":
        if not msg.token_ids.ids:
            raise InvalidInput(f"{field}.token_ids must not be empty")
        return PromptInput(token_ids=tuple(msg.token_ids.ids))
    if kind == "chat":
        messages = tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidInput(f"{field}.chat.messages[{i}].role must not be empty")
        return PromptInput(
            messages=messages, add_generation_prompt=not msg.chat.no_generation_prompt
        )
    raise InvalidInput(f"{field} must be set: text, token_ids or chat")


def sampling_from_proto(msg: pb.SamplingParams, config: RouterConfig) -> SamplingParams:
    """Engine sampling parameters; unset optional fields take their defaults."""
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else 16
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    n = msg.n if msg.HasField("n") else 1
    beam_width = msg.beam_width if msg.HasField("beam_width") else 1
    _check(max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {max_tokens}")
    _check(
        math.isfinite(temperature) and temperature >= 0,
        f"sampling.temperature must be a finite number >= 0, got {temperature}",
    )
    _check(msg.top_k >= 0, f"sampling.top_k must be >= 0 (0 is off), got {msg.top_k}")
    _check(0 < top_p <= 1, f"sampling.top_p must be in (0, 1], got {top_p:g}")
    _check(1 <= n <= config.max_n, f"sampling.n must be in [1, {config.max_n}], got {n}")
    _check(
        1 <= beam_width <= config.max_beam_width,
        f"sampling.beam_width must be in [1, {config.max_beam_width}], got {beam_width}",
    )
    _check(
        len(msg.stop) <= _MAX_STOP_STRINGS,
        f"sampling.stop has {len(msg.stop)} strings; at most {_MAX_STOP_STRINGS}",
    )
    for i, stop in enumerate(msg.stop):
        _check(bool(stop), f"sampling.stop[{i}] must not be empty")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=msg.top_k,
            top_p=top_p,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            n=n,
            beam_width=beam_width,
        )
    except ValueError as exc:  # a rule of the engine's that the checks above do not cover
        raise InvalidInput(f"sampling: {exc}") from exc


def generate_from_proto(msg: pb.GenerateRequest, config: RouterConfig) -> GenerateInput:
    check_request_id(msg.request_id)
    params = sampling_from_proto(msg.sampling, config)
    salt = msg.cache_salt if msg.HasField("cache_salt") else None
    _check_salt(salt)
    return GenerateInput(
        request_id=msg.request_id,
        prompt=prompt_from_proto(msg.prompt),
        params=params,
        cache_salt=salt,
        use_response_cache=not msg.no_response_cache,
        # Set, it is the client's: past the context it is refused (unset, lowered to fit).
        max_tokens_set=msg.sampling.HasField("max_tokens"),
        retention_s=check_retention_s(msg.retention_s),
        affinity_key=_affinity_key(msg),
        retention_tokens=_retention_tokens(msg),
        session_id=check_session_id(msg.session_id),
        skip_cache_read=msg.skip_cache_read,
        skip_cache_write=msg.skip_cache_write,
        explain_cache=msg.explain_cache,
    )


def prewarm_from_proto(msg: pb.PrewarmRequest) -> PrewarmInput:
    salt = msg.cache_salt if msg.HasField("cache_salt") else None
    _check_salt(salt)
    return PrewarmInput(
        request_id="",
        prompt=prompt_from_proto(msg.prompt),
        cache_salt=salt,
        retention_s=check_retention_s(msg.retention_s),
        session_id=check_session_id(msg.session_id),
        affinity_key=_affinity_key(msg),
    )


def prewarm_to_proto(result: PrewarmResult) -> pb.PrewarmResponse:
    return pb.PrewarmResponse(
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        worker_id=result.worker_id,
        retained_tokens=result.retained_tokens,
        retention_trimmed_tokens=result.retention_trimmed_tokens,
    )


def _retention_tokens(msg: pb.GenerateRequest) -> int | None:
    if not msg.HasField("retention_tokens"):
        return None
    tokens = msg.retention_tokens
    _check(tokens >= 1, f"retention_tokens must be >= 1 (unset: the whole prompt), got {tokens}")
    return tokens


def _affinity_key(msg: pb.GenerateRequest | pb.PrewarmRequest) -> str | None:
    key = msg.affinity_key
    _check(
        len(key) <= MAX_AFFINITY_KEY_LEN,
        f"affinity_key is {len(key)} characters; at most {MAX_AFFINITY_KEY_LEN}",
    )
    return key or None


def score_from_proto(msg: pb.ScoreRequest) -> ScoreInput:
    check_request_id(msg.request_id)
    salt = msg.cache_salt if msg.HasField("cache_salt") else None
    _check_salt(salt)
    items = []
    for i, item in enumerate(msg.items):
        if item.WhichOneof("kind") not in ("text", "token_ids"):
            raise InvalidInput(f"items[{i}] must be text or token_ids")
        items.append(prompt_from_proto(item, f"items[{i}]"))
    prefix = prompt_from_proto(msg.prefix, "prefix")
    _check_score_answer_size(len(items), len(msg.label_token_ids))
    return ScoreInput(msg.request_id, prefix, tuple(items), tuple(msg.label_token_ids), salt)


def _check_score_answer_size(num_items: int, num_labels: int) -> None:
    """Refuse before any work a Score whose answer (a float32 per item and label) would be
    larger than a client takes in one message: it could never be delivered."""
    size = num_items * (4 * num_labels + _ITEM_BYTES)
    _check(
        size <= _MAX_ANSWER_BYTES,
        f"items x label_token_ids: {num_items} x {num_labels} log-probs make an answer of "
        f"{size} bytes, over the {_MAX_ANSWER_BYTES} a gRPC message holds; "
        "send fewer items or label_token_ids",
    )


def delta_to_proto(request_id: str, delta: StreamDelta) -> pb.GenerateResponse:
    out = pb.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=delta.finish_reason or "",
    )
    if delta.usage is not None:
        u = delta.usage
        out.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=dict(u.cached_tokens),
                computed_tokens=u.computed_tokens,
                worker_id=u.worker_id,
                ttft_ms=u.ttft_ms,
                decode_tokens_per_s=u.decode_tokens_per_s or 0.0,
                from_response_cache=u.from_response_cache,
                prefill_worker_id=u.prefill_worker_id or "",
                kv_transfer_tokens=u.kv_transfer_tokens,
                cache_write_tokens=u.cache_write_tokens,
                retained_tokens=u.retained_tokens,
                retention_trimmed_tokens=u.retention_trimmed_tokens,
                explanation=explanation_to_proto(u),
            )
        )
    return out


def explanation_to_proto(usage: Usage) -> pb.CacheExplanation | None:
    """The usage's explanation (`router.request.explain`); None when none was asked."""
    segments = explanation_of(usage)
    if segments is None:
        return None
    return pb.CacheExplanation(
        segments=[
            pb.CacheSegment(
                start_token=s.start_token,
                end_token=s.end_token,
                source=s.source,
                worker_id=s.worker_id,
                miss_reason=s.miss_reason,
            )
            for s in segments
        ]
    )


def score_to_proto(result: ScoreResult) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        scores=[pb.ItemScores(logprobs=row) for row in result.logprobs],
        worker_id=result.worker_id,
    )


def worker_to_proto(status: WorkerStatus) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=status.worker_id,
        health=_HEALTH.get(status.health, pb.WorkerInfo.HEALTH_UNSPECIFIED),
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        num_queued_tokens=status.num_queued_tokens,
        blocks={
            tier: pb.TierBlocks(total=total, used=used, cached=cached)
            for tier, (total, used, cached) in status.blocks.items()
        },
        num_inflight=status.num_inflight,
        num_indexed_blocks=status.num_indexed_blocks,
        role=status.role,
    )


def stats_to_proto(stats: RouterStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        policy=stats.policy,
        num_requests=stats.num_requests,
        num_failed=stats.num_failed,
        num_retries=stats.num_retries,
        num_inflight=stats.num_inflight,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        cache_hit_ratio=stats.cache_hit_ratio,
        num_resyncs=stats.num_resyncs,
        block_size=stats.block_size,
        model_fingerprint=stats.model_fingerprint,
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidInput(message)


def _check_salt(salt: str | None) -> None:
    # Hashed into block keys, not echoed or logged: any text, of a bounded length.
    if salt is not None and len(salt) > MAX_ID_LEN:
        raise InvalidInput(f"cache_salt is {len(salt)} characters; at most {MAX_ID_LEN}")


# ---- bodies that do not parse -------------------------------------------------------------


def undecodable_reason(descriptor: Descriptor, data: bytes) -> str:
    """Why `data` (which did not parse as `descriptor`'s message) is no such message, naming
    the field where that can be told: a string field of invalid UTF-8 (proto3 refuses those)
    is found by parsing the body again with every string field read as bytes."""
    try:
        twin = _bytes_twin(descriptor).FromString(data)
    except DecodeError:
        return f"request body is not a valid {descriptor.full_name} message"
    path = _bad_utf8_field(twin, descriptor, "")
    suffix = f": {path} is not valid UTF-8" if path else ""
    return f"request body is not a valid {descriptor.full_name} message{suffix}"


@functools.cache
def _bytes_twin(descriptor: Descriptor) -> type[Message]:
    """`descriptor`'s message with each string field declared bytes (the same wire format), in
    a pool of its own."""
    pool = descriptor_pool.DescriptorPool()
    _add_twin(pool, descriptor.file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.full_name))


def _add_twin(pool: descriptor_pool.DescriptorPool, file: FileDescriptor) -> None:
    try:
        pool.FindFileByName(file.name)
        return  # added already (a dependency of two files)
    except KeyError:
        pass
    for dependency in file.dependencies:
        _add_twin(pool, dependency)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    todo = list(proto.message_type)
    while todo:
        message = todo.pop()
        todo.extend(message.nested_type)
        if message.options.map_entry:
            continue  # a map's key may not be bytes: an invalid key stays unnamed
        for f in message.field:
            if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool.Add(proto)


def _bad_utf8_field(twin: Message, original: Descriptor, path: str) -> str | None:
    """The path (`prompt.chat.messages[2].content`) of the first string field in `twin` that
    is not UTF-8; `original` says which of its bytes fields are strings."""
    for f, value in twin.ListFields():
        declared = original.fields_by_number[f.number]
        is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
        if is_map or declared.type not in (
            FieldDescriptor.TYPE_STRING,
            FieldDescriptor.TYPE_MESSAGE,
        ):
            continue
        values = list(enumerate(value)) if f.is_repeated else [(None, value)]
        for i, v in values:
            where = f"{path}{f.name}" + ("" if i is None else f"[{i}]")
            if declared.type == FieldDescriptor.TYPE_MESSAGE:
                found = _bad_utf8_field(v, declared.message_type, f"{where}.")
                if found is not None:
                    return found
            elif not _is_utf8(v):
                return where
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
