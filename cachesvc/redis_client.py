"""Redis clients that never retry a call by themselves.

redis-py retries a failed call (with backoff) by default, so a Redis that stops answering would
cost each call several timeouts. Every client here makes one attempt: a call costs at most one
`timeout_s`, and whoever holds the client decides when to try again (a circuit breaker, a
thread that retries whole batches). redis is imported lazily: only deployments with Redis need
it.
"""

from __future__ import annotations

from typing import Any


def redis_client(url: str, timeout_s: float, **options: Any) -> Any:
    """A blocking client of `url` (redis:// or rediss://); `options` go to `Redis.from_url`
    (`decode_responses`, `password`, `ssl_ca_certs`, ...)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        **options,
    )


def async_redis_client(url: str, timeout_s: float, **options: Any) -> Any:
    """The asyncio client of `url`, alike (for a router's event loop)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        **options,
    )
