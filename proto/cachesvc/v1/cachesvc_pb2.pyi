from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "no_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NO_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    no_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., no_generation_prompt: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "n", "beam_width", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    beam_width: int
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., beam_width: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "cache_salt", "no_response_cache", "affinity_key", "retention_s", "session_id", "skip_cache_read", "skip_cache_write", "explain_cache", "retention_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NO_RESPONSE_CACHE_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_KEY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHE_READ_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHE_WRITE_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_CACHE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    cache_salt: str
    no_response_cache: bool
    affinity_key: str
    retention_s: int
    session_id: str
    skip_cache_read: bool
    skip_cache_write: bool
    explain_cache: bool
    retention_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., no_response_cache: _Optional[bool] = ..., affinity_key: _Optional[str] = ..., retention_s: _Optional[int] = ..., session_id: _Optional[str] = ..., skip_cache_read: _Optional[bool] = ..., skip_cache_write: _Optional[bool] = ..., explain_cache: _Optional[bool] = ..., retention_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "computed_tokens", "worker_id", "ttft_ms", "decode_tokens_per_s", "from_response_cache", "prefill_worker_id", "kv_transfer_tokens", "cache_write_tokens", "retained_tokens", "retention_trimmed_tokens", "explanation")
    class CachedTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FROM_RESPONSE_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_TRIMMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: _containers.ScalarMap[str, int]
    computed_tokens: int
    worker_id: str
    ttft_ms: float
    decode_tokens_per_s: float
    from_response_cache: bool
    prefill_worker_id: str
    kv_transfer_tokens: int
    cache_write_tokens: int
    retained_tokens: int
    retention_trimmed_tokens: int
    explanation: CacheExplanation
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[_Mapping[str, int]] = ..., computed_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., from_response_cache: _Optional[bool] = ..., prefill_worker_id: _Optional[str] = ..., kv_transfer_tokens: _Optional[int] = ..., cache_write_tokens: _Optional[int] = ..., retained_tokens: _Optional[int] = ..., retention_trimmed_tokens: _Optional[int] = ..., explanation: _Optional[_Union[CacheExplanation, _Mapping]] = ...) -> None: ...

class CacheSegment(_message.Message):
    __slots__ = ("start_token", "end_token", "source", "worker_id", "miss_reason")
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    start_token: int
    end_token: int
    source: str
    worker_id: str
    miss_reason: str
    def __init__(self, start_token: _Optional[int] = ..., end_token: _Optional[int] = ..., source: _Optional[str] = ..., worker_id: _Optional[str] = ..., miss_reason: _Optional[str] = ...) -> None: ...

class CacheExplanation(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[CacheSegment]
    def __init__(self, segments: _Optional[_Iterable[_Union[CacheSegment, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "prefix", "items", "label_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix: Prompt
    items: _containers.RepeatedCompositeFieldContainer[Prompt]
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prefix: _Optional[_Union[Prompt, _Mapping]] = ..., items: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., label_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ItemScores(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "worker_id")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScores]
    worker_id: str
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScores, _Mapping]]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "continuation")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    continuation: bool
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., continuation: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "num_blocks", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("prompt", "cache_salt", "retention_s", "session_id", "affinity_key")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_KEY_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    cache_salt: str
    retention_s: int
    session_id: str
    affinity_key: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., cache_salt: _Optional[str] = ..., retention_s: _Optional[int] = ..., session_id: _Optional[str] = ..., affinity_key: _Optional[str] = ...) -> None: ...

class PrewarmResponse(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "worker_id", "retained_tokens", "retention_trimmed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_TRIMMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    worker_id: str
    retained_tokens: int
    retention_trimmed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., retained_tokens: _Optional[int] = ..., retention_trimmed_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_blocks_released",)
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_released: int
    def __init__(self, num_blocks_released: _Optional[int] = ...) -> None: ...

class TenantQuota(_message.Message):
    __slots__ = ("tenant", "share", "max_retention_s", "retention_share")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    MAX_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SHARE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    share: float
    max_retention_s: int
    retention_share: float
    def __init__(self, tenant: _Optional[str] = ..., share: _Optional[float] = ..., max_retention_s: _Optional[int] = ..., retention_share: _Optional[float] = ...) -> None: ...

class SetTenantQuotaRequest(_message.Message):
    __slots__ = ("quota",)
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    quota: TenantQuota
    def __init__(self, quota: _Optional[_Union[TenantQuota, _Mapping]] = ...) -> None: ...

class SetTenantQuotaResponse(_message.Message):
    __slots__ = ("quota",)
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    quota: TenantQuota
    def __init__(self, quota: _Optional[_Union[TenantQuota, _Mapping]] = ...) -> None: ...

class TenantUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantTierUsage(_message.Message):
    __slots__ = ("cached", "retained")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    cached: int
    retained: int
    def __init__(self, cached: _Optional[int] = ..., retained: _Optional[int] = ...) -> None: ...

class TenantUsageEntry(_message.Message):
    __slots__ = ("quota", "tiers")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TenantTierUsage
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TenantTierUsage, _Mapping]] = ...) -> None: ...
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    quota: TenantQuota
    tiers: _containers.MessageMap[str, TenantTierUsage]
    def __init__(self, quota: _Optional[_Union[TenantQuota, _Mapping]] = ..., tiers: _Optional[_Mapping[str, TenantTierUsage]] = ...) -> None: ...

class TenantUsageResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsageEntry]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantUsageEntry, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("total", "used", "cached")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    total: int
    used: int
    cached: int
    def __init__(self, total: _Optional[int] = ..., used: _Optional[int] = ..., cached: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "health", "num_running", "num_waiting", "num_queued_tokens", "blocks", "num_inflight", "num_indexed_blocks", "role")
    class Health(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        HEALTH_UNSPECIFIED: _ClassVar[WorkerInfo.Health]
        HEALTHY: _ClassVar[WorkerInfo.Health]
        UNHEALTHY: _ClassVar[WorkerInfo.Health]
        DEAD: _ClassVar[WorkerInfo.Health]
    HEALTH_UNSPECIFIED: WorkerInfo.Health
    HEALTHY: WorkerInfo.Health
    UNHEALTHY: WorkerInfo.Health
    DEAD: WorkerInfo.Health
    class BlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierBlocks
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierBlocks, _Mapping]] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    health: WorkerInfo.Health
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    blocks: _containers.MessageMap[str, TierBlocks]
    num_inflight: int
    num_indexed_blocks: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., health: _Optional[_Union[WorkerInfo.Health, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., blocks: _Optional[_Mapping[str, TierBlocks]] = ..., num_inflight: _Optional[int] = ..., num_indexed_blocks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("policy", "num_requests", "num_failed", "num_retries", "num_inflight", "prompt_tokens", "cached_tokens", "cache_hit_ratio", "num_resyncs", "block_size", "model_fingerprint")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_RETRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    NUM_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    policy: str
    num_requests: int
    num_failed: int
    num_retries: int
    num_inflight: int
    prompt_tokens: int
    cached_tokens: int
    cache_hit_ratio: float
    num_resyncs: int
    block_size: int
    model_fingerprint: str
    def __init__(self, policy: _Optional[str] = ..., num_requests: _Optional[int] = ..., num_failed: _Optional[int] = ..., num_retries: _Optional[int] = ..., num_inflight: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cache_hit_ratio: _Optional[float] = ..., num_resyncs: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("num_blocks_dropped",)
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_dropped: int
    def __init__(self, num_blocks_dropped: _Optional[int] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("num_blocks_purged",)
    class NumBlocksPurgedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_BLOCKS_PURGED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_purged: _containers.ScalarMap[str, int]
    def __init__(self, num_blocks_purged: _Optional[_Mapping[str, int]] = ...) -> None: ...
