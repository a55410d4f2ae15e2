"""The router's configuration: one frozen object, validated at start-up.

This module, `tenants.py` (the tenant tokens file) and the CLI are the only places of the router
that read files: the tenant tokens file and, once at start, the TLS certificate files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cachesvc.kv.config import MIN_TIER_KEY_BYTES, ConfigError
from router.tenants import TenantToken, check_tenant_token

_TLS_FILES = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")


@dataclass(frozen=True)
class ServerTls:
    """The router's TLS files, read (`RouterConfig.read_tls`): PEM bytes for grpc."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    # Mutual TLS: clients must present a certificate this CA signed. None: any client.
    client_ca: bytes | None = None


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, routes and protects itself.

    `auth_token` and `tenant_tokens` set means every RPC but health checks needs
    `authorization: Bearer <token>` with one of them. A tenant's token also isolates its cache
    (see `router.auth.tenant_cache_salt`); `auth_token` is the operator's: no tenant, and the
    only token that may call the Admin service. `tls_cert_file` and `tls_key_file` (PEM) make
    the router speak TLS; `tls_client_ca_file` also requires client certificates it signed.

    The `prefix_aware` policy (`router.policy.routing.PrefixAware`) scores each worker in tokens of
    work: the prompt it would compute (cached blocks in lower tiers weighted by the worker's
    own fetch costs) plus `route_queue_weight` times its queued work. Two bounds protect against
    overload: a worker whose queued work (in seconds at its reported speed) exceeds
    `balance_queue_factor` times the least-queued worker's plus `balance_queue_slack_s` seconds
    is not chosen, and neither is one with more than
    `balance_abs_threshold` requests above the least-loaded one *and* more than
    `balance_rel_threshold` times its count, nor (while another is not) one given more than
    `balance_traffic_factor` times the candidates' mean number of recent requests, which grows a
    second holder for a hot prefix (0 turns it off; recent requests decay with a half-life of
    `route_work_half_life_s` seconds). The router measures each worker's busy seconds lately
    (time with requests, half-life `route_busy_half_life_s`); a worker that was busier than
    the mean scores `route_busy_weight` times its excess worse, as tokens of the
    work the cluster did per busy second lately, so a cached prefix keeps a request on a busy
    worker only while recomputing it elsewhere would cost more. Workers scoring within
    `route_tie_fraction` of the prompt's length of the best are near ties: the least busy
    lately (plus its queued seconds) wins, which spreads new prefix groups. Being per worker
    and in seconds, the defaults hold for any cluster size.

    With `peer_pull` (and workers started with `engine.peer_pull`), a worker's score counts
    the prefix another worker holds at the worker's calibrated cost of pulling it, not of
    computing it, and the request carries that holder's name for the worker's load planner: a
    busy holder no longer forces a choice between its queue and a recompute.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "prefix_aware"
    auth_token: str | None = field(default=None, repr=False)
    tenant_tokens: tuple[TenantToken, ...] = ()
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    max_n: int = 16
    max_beam_width: int = 16
    max_inflight: int = 1024
    max_retries: int = 2
    poll_interval_s: float = 0.05
    # While a worker has requests it is polled (and pinged) this often instead: each round is two
    # Ray calls, ~1 ms of CPU in the router and the worker together, and at 20 a second they took
    # 6-8% from a two-core worker's prefill (docs/benchmarks/serve.md). The router counts what
    # it sent itself meanwhile (`WorkerState.num_inflight`), so routing does not wait on a poll.
    busy_poll_interval_s: float = 0.5
    # Each worker's streams reach the router over one Ray stream, what a step gave them all in
    # one item (`router/pool/worker_mux.py`), instead of a Ray stream per request whose every
    # item costs both processes CPU that a small machine takes from the worker's steps.
    multiplex_streams: bool = True
    call_timeout_s: float = 10.0
    max_missed_polls: int = 3
    # A ping is answered on a thread of its own, never behind a step: `max_missed_polls`
    # unanswered (`ping_timeout_s` each) in a row make a worker unhealthy, and a stream waiting
    # on it fails over (checked every `stall_check_s`); an answered ping clears the count. A
    # long step is no failure: only one that has run for `hang_after_s` (or an event loop that
    # has not turned for that long), far longer than any real step, is a hang. A poll that times
    # out is not a missed ping. Unhealthy for `dead_after_s`, a worker is dead: killed, and
    # replaced (when the router owns its workers) at most `max_replacements` times, backing off
    # from `replace_backoff_s`; a replacement has `start_timeout_s` to load its model.
    ping_timeout_s: float = 2.0
    stall_check_s: float = 0.5
    hang_after_s: float = 120.0
    dead_after_s: float = 60.0
    max_replacements: int = 10
    replace_backoff_s: float = 1.0
    start_timeout_s: float = 600.0
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 2.0
    balance_queue_factor: float = 2.0
    balance_queue_slack_s: float = 2.0
    balance_traffic_factor: float = 1.5
    route_queue_weight: float = 0.25
    route_tie_fraction: float = 0.1
    route_work_half_life_s: float = 30.0
    route_busy_weight: float = 1.0
    route_busy_half_life_s: float = 120.0
    peer_pull: bool = True
    # Prefill/decode disaggregation, when some workers have the role "prefill"
    # (`router/policy/pd.py`): "auto" decides per request from the workers' calibrated costs and
    # loads, "always" hands every request it can to a prefill worker, "never" serves each where it
    # is routed. A second a decoding stream loses counts `pd_stall_weight` times a second of the
    # request's own wait (with both targets below set, their own weight instead:
    # `SLO.stall_weight`).
    pd_mode: str = "auto"
    pd_stall_weight: float = 1.0
    # Latency targets for "auto" (None: none): the mode predicted to break fewer of them wins
    # (a request's time to first token; any stream's mean gap between tokens, a stall spread
    # over the mean answer seen so far), the delays above decide between modes that break as
    # many.
    pd_ttft_slo_ms: float | None = None
    pd_itl_slo_ms: float | None = None
    # With no prefill workers and two or more mixed ones, per request ("auto") or for every
    # request ("always") compute the prompt where the policy chose (or where it stalls fewer
    # streams, `pick_prefill`) and hand the decode to another mixed worker. Off by default:
    # simulated on long prompts it serves up to 1.4x colocated's goodput, on the sample trace
    # it ties colocated (docs/benchmarks/pd.md); every worker must pull from its peers.
    pd_mixed: bool = False
    # A handed-off request's decode worker pulls the prompt's KV while its prefill runs, chunk
    # by chunk as the prefill worker computes it (`router/request/prefetch.py`), rather than after
    # the first token only.
    pd_prefetch: bool = True
    # A worker with this many requests (running, waiting or in flight from this router) gets no
    # more: when every worker is that full, a call fails with RESOURCE_EXHAUSTED. None: no limit.
    max_queued_per_worker: int | None = None
    # Refuse (RESOURCE_EXHAUSTED, HTTP 429) a request predicted to wait longer than this for
    # its first token where it would run (`router/policy/admission.py`): past capacity the requests
    # admitted then meet their target instead of none. None: admit every request. The
    # prediction is scaled by what admitted requests took against theirs, so this is the
    # TTFT target itself.
    admit_ttft_ms: float | None = None
    # Refuse as well a request that would join or stall the streams of a worker that lately
    # decodes them slower than this between tokens (its measured mean gap, plus the request's
    # own prefill spread over an answer): its streams keep their inter-token target. None:
    # never refuse for the streams.
    admit_itl_ms: float | None = None
    # Share the prefix index through Redis (several routers, restarts); None keeps it in memory.
    redis_url: str | None = None
    redis_namespace: str = "cachesvc"
    # Serve Prometheus metrics on http://host:metrics_port/metrics (0: any free port).
    metrics_port: int | None = None
    # Also serve the health service alone, in plaintext, on 127.0.0.1:health_port (0: any free
    # port): for probes inside the pod that cannot speak (mutual) TLS. None: no such port.
    health_port: int | None = None
    # Also serve the OpenAI-compatible HTTP door (router/http/) on host:http_port (0: any free
    # port), over TLS when the gRPC port is; its model is called `served_model_name` (None: the
    # name `cachesvc serve` derives from the model path). None: no HTTP door.
    http_port: int | None = None
    served_model_name: str | None = None
    # The response cache (router/response_cache/cache.py): deterministic requests' answers, in
    # memory up to this many MiB (0: off), or in Redis when `response_cache_redis_url` (else
    # `redis_url`) is set: shared by the routers, each entry kept `response_cache_ttl_s`, a
    # lookup bounded by `response_cache_timeout_s`. Answers over `response_cache_max_entry_kb`
    # are not stored, nor more than `response_cache_queue_entries` waiting to be written.
    # Entries are signed with the key in `response_cache_key_file` (None: a key of this
    # process alone, which no other router can check).
    response_cache_mb: float = 64.0
    response_cache_ttl_s: float = 3600.0
    response_cache_redis_url: str | None = None
    response_cache_timeout_s: float = 0.05
    response_cache_max_entry_kb: float = 256.0
    response_cache_queue_entries: int = 256
    response_cache_key_file: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        self._check_tokens()
        self._check_tls()
        self._check_response_cache()
        if self.max_replacements < 0:
            raise ConfigError(f"max_replacements must be >= 0, got {self.max_replacements}")
        for name in ("max_n", "max_beam_width", "max_inflight", "max_missed_polls"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "poll_interval_s",
            "busy_poll_interval_s",
            "call_timeout_s",
            "ping_timeout_s",
            "stall_check_s",
            "hang_after_s",
            "dead_after_s",
            "replace_backoff_s",
            "start_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_queued_per_worker is not None and self.max_queued_per_worker < 1:
            raise ConfigError(
                f"max_queued_per_worker must be positive, got {self.max_queued_per_worker}"
            )
        for name in ("metrics_port", "health_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535], got {value}")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(
                f"redis url must look like redis://host:port/db, got {self.redis_url!r}"
            )
        if self.max_retries < 0 or self.balance_abs_threshold < 0:
            raise ConfigError("max_retries and balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1:
            raise ConfigError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}"
            )
        self._check_routing()

    def policy_options(self) -> dict[str, float]:
        """The routing thresholds as `router.policy.routing.make_policy` takes them."""
        return {
            "abs_threshold": self.balance_abs_threshold,
            "rel_threshold": self.balance_rel_threshold,
            "queue_factor": self.balance_queue_factor,
            "queue_slack_s": self.balance_queue_slack_s,
            "traffic_factor": self.balance_traffic_factor,
            "queue_weight": self.route_queue_weight,
            "tie_fraction": self.route_tie_fraction,
            "work_half_life_s": self.route_work_half_life_s,
            "busy_weight": self.route_busy_weight,
            "busy_half_life_s": self.route_busy_half_life_s,
        }

    def _check_routing(self) -> None:
        if self.pd_mode not in ("auto", "always", "never"):
            raise ConfigError(f"pd_mode must be auto, always or never, got {self.pd_mode!r}")
        if self.pd_stall_weight < 0:
            raise ConfigError(f"pd_stall_weight must be >= 0, got {self.pd_stall_weight}")
        for name in ("pd_ttft_slo_ms", "pd_itl_slo_ms", "admit_ttft_ms", "admit_itl_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.balance_queue_factor < 1:
            raise ConfigError(
                f"balance_queue_factor must be >= 1 (a worker may always queue as much as the "
                f"least-queued one), got {self.balance_queue_factor}"
            )
        if self.balance_queue_slack_s < 0:
            raise ConfigError(
                f"balance_queue_slack_s must be >= 0 (seconds of work), got "
                f"{self.balance_queue_slack_s}"
            )
        if self.balance_traffic_factor != 0 and self.balance_traffic_factor < 1:
            raise ConfigError(
                f"balance_traffic_factor must be 0 (off) or >= 1 (times the mean of recent "
                f"requests), got {self.balance_traffic_factor}"
            )
        if not 0 <= self.route_queue_weight <= 1:
            raise ConfigError(
                f"route_queue_weight must be in [0, 1] (0: queues count only through the "
                f"bounds; 1: a queued token weighs as much as a prompt token), got "
                f"{self.route_queue_weight}"
            )
        if not 0 <= self.route_tie_fraction <= 1:
            raise ConfigError(
                f"route_tie_fraction must be in [0, 1] (a fraction of the prompt's length), got "
                f"{self.route_tie_fraction}"
            )
        if self.route_busy_weight < 0:
            raise ConfigError(
                f"route_busy_weight must be >= 0 (0: busy seconds only break near ties), got "
                f"{self.route_busy_weight}"
            )
        if self.route_busy_half_life_s <= 0:
            raise ConfigError(
                f"route_busy_half_life_s must be positive (seconds), got "
                f"{self.route_busy_half_life_s}"
            )
        if self.route_work_half_life_s <= 0:
            raise ConfigError(
                f"route_work_half_life_s must be positive (seconds), got "
                f"{self.route_work_half_life_s}"
            )

    def read_tls(self) -> ServerTls | None:
        """The TLS files' bytes (reads them); None without TLS."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        ca = self.tls_client_ca_file
        return ServerTls(
            cert_chain=Path(self.tls_cert_file).read_bytes(),
            private_key=Path(self.tls_key_file).read_bytes(),
            client_ca=None if ca is None else Path(ca).read_bytes(),
        )

    def _check_tokens(self) -> None:
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("auth token is empty: put the token in the file, or drop the flag")
        owners = {} if self.auth_token is None else {self.auth_token: "auth_token"}
        for i, entry in enumerate(self.tenant_tokens):
            where = f"tenant_tokens[{i}]"
            check_tenant_token(entry.tenant, entry.token, where)
            if entry.token in owners:
                raise ConfigError(
                    f"{where}: tenant {entry.tenant!r} has the token of {owners[entry.token]}: "
                    "give every tenant a token of its own"
                )
            owners[entry.token] = where

    def _check_response_cache(self) -> None:
        if self.response_cache_mb < 0:
            raise ConfigError(f"response_cache_mb must be >= 0, got {self.response_cache_mb}")
        for name in (
            "response_cache_ttl_s",
            "response_cache_timeout_s",
            "response_cache_max_entry_kb",
            "response_cache_queue_entries",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        url = self.response_cache_redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"response_cache_redis_url must look like redis://host:port/db, got {url!r}"
            )
        if self.response_cache_key_file is not None and not self.response_cache_key_file.strip():
            raise ConfigError("response_cache_key_file must name a file or be None")

    def read_response_cache_key(self) -> bytes | None:
        """The secret that signs response-cache entries: the bytes of `response_cache_key_file`
        without surrounding whitespace (reads it); None without the file. Raises ConfigError,
        saying how to make one, when it is unreadable or too short."""
        path = self.response_cache_key_file
        if path is None:
            return None
        make = f"make one with: head -c 32 /dev/urandom | base64 > {path}"
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            reason = exc.strerror or exc
            raise ConfigError(
                f"response_cache_key_file: cannot read {path}: {reason}; {make}"
            ) from None
        if len(key) < MIN_TIER_KEY_BYTES:
            raise ConfigError(
                f"response_cache_key_file: {path} holds {len(key)} bytes, the key needs at least "
                f"{MIN_TIER_KEY_BYTES} (not counting whitespace); {make}"
            )
        return key

    def _check_tls(self) -> None:
        cert, key, ca = self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
        if (cert is None) != (key is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if key is None
                else ("tls_key_file", "tls_cert_file")
            )
            raise ConfigError(
                f"{given} is set but {missing} is not: TLS needs both the certificate and its "
                f"private key ({_flag(given)} and {_flag(missing)}), or neither"
            )
        if ca is not None and cert is None:
            raise ConfigError(
                "tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS runs over "
                "TLS; give the router's certificate and key too, or drop --tls-client-ca-file"
            )
        for name in _TLS_FILES:
            if getattr(self, name) is not None:
                _check_pem_file(name, getattr(self, name))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_pem_file(name: str, value: str) -> None:
    path = Path(value)
    fix = f"give the path of a PEM file ({_flag(name)})"
    if not path.is_file():
        raise ConfigError(f"{name}: no such file {value!r}: {fix}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{name}: {value!r} is not readable by this user: fix its permissions")
    if b"-----BEGIN " not in path.read_bytes():
        raise ConfigError(f"{name}: {value!r} is not PEM (no '-----BEGIN' line): {fix}")
