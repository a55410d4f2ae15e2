"""The router's configuration: one frozen object, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from cachesvc.config import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, routes and protects itself.

    `auth_token` set means every RPC but health checks needs `authorization: Bearer <token>`.
    The balance thresholds bound load imbalance: a worker with more than
    `balance_abs_threshold` requests above the least-loaded one *and* more than
    `balance_rel_threshold` times its load is not chosen for its cached prefix.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "prefix_aware"
    auth_token: str | None = None
    max_n: int = 16
    max_beam_width: int = 16
    max_inflight: int = 1024
    max_retries: int = 2
    poll_interval_s: float = 0.05
    call_timeout_s: float = 10.0
    max_missed_polls: int = 3
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    # A worker with this many requests (running, waiting or in flight from this router) gets no
    # more: when every worker is that full, a call fails with RESOURCE_EXHAUSTED. None: no limit.
    max_queued_per_worker: int | None = None
    # Share the prefix index through Redis (several routers, restarts); None keeps it in memory.
    redis_url: str | None = None
    redis_namespace: str = "cachesvc"
    # Serve Prometheus metrics on http://host:metrics_port/metrics (0: any free port).
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("auth token is empty: put the token in the file, or drop the flag")
        for name in ("max_n", "max_beam_width", "max_inflight", "max_missed_polls"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("poll_interval_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_queued_per_worker is not None and self.max_queued_per_worker < 1:
            raise ConfigError(
                f"max_queued_per_worker must be positive, got {self.max_queued_per_worker}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port must be in [0, 65535], got {self.metrics_port}")
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
