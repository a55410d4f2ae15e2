"""Redis clients that never retry a call by themselves.

redis-py retries a failed call (with backoff) by default, so a Redis that stops answering would
cost each call several timeouts. Every client here makes one attempt: a call costs at most one
`timeout_s`, and whoever holds the client decides when to try again (a circuit breaker, a
thread that retries whole batches). A `PreconnectedClient` also keeps its connects, with their
longer bound, off its calls. redis is imported lazily: only deployments with Redis need it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_log = logging.getLogger(__name__)


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


class PreconnectedClient:
    """A blocking client of `url` whose calls never open a connection.

    A connect and its handshake (TLS, AUTH, the client's SETINFO) can take longer than a
    request-path call's bound, and would then fail every time. So the connection is opened
    ahead, on a thread of its own, with the longer `connect_timeout_s` for the connect and the
    handshake together; only once it is open are its calls bounded by `timeout_s`. `client()`
    is None until then, and again after `lost()` (a call failed: redis-py has closed the
    connection), when it starts the next attempt. Attempts are paced by the caller's `breaker`
    (a `CircuitBreaker`): each one is a call it allowed, and is told how it went. Thread-safe;
    `up` and the log say whether the connection is open.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        connect_timeout_s: float,
        name: str,
        **options: Any,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.num_connect_failures = 0
        self._url, self._name, self._options = url, name, options
        self._client: Any = None
        self._attempt: threading.Thread | None = None
        self._warned = False  # the current outage has been logged
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._client is not None

    def client(self, breaker: Any) -> Any:
        """The connected client, or None while there is none (an attempt to open one is then
        started, unless one is under way or `breaker` refuses). Never blocks."""
        client = self._client
        if client is None:
            self._start_attempt(breaker)
        return client

    def connect(self, breaker: Any) -> bool:
        """Open the connection now, or wait for the attempt under way (at most
        `connect_timeout_s`); whether it is open. For start-up, not the request path."""
        attempt = self._start_attempt(breaker)
        if attempt is not None:
            attempt.join()
        return self.up

    def lost(self) -> None:
        """A call on the client failed: drop it; the next `client()` reconnects."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _log.info("%s: connection to Redis lost; reconnecting in the background", self._name)
            client.close()

    def _start_attempt(self, breaker: Any) -> threading.Thread | None:
        with self._lock:
            if self._client is not None:
                return None
            if self._attempt is None or not self._attempt.is_alive():
                if not breaker.allow():
                    return None
                self._attempt = threading.Thread(target=self._open, args=(breaker,), daemon=True)
                self._attempt.start()
            return self._attempt

    def _open(self, breaker: Any) -> None:
        import redis

        # Built here, not ahead: a single-connection client connects when it is built.
        client = None
        try:
            client = redis_client(
                self._url, self.connect_timeout_s, single_connection_client=True, **self._options
            )
            client.ping()
        except (redis.RedisError, OSError) as exc:
            if client is not None:
                client.close()
            self.num_connect_failures += 1
            breaker.failed()
            if not self._warned:  # one line per outage
                self._warned = True
                _log.warning(
                    "%s: cannot connect to Redis (retrying): %s: %s",
                    self._name,
                    type(exc).__name__,
                    exc,
                )
            return
        except BaseException:
            breaker.failed()  # never leave a half-open breaker's probe outstanding
            raise
        # Open: from now on its calls get the short bound.
        client.connection.socket_timeout = self.timeout_s
        client.connection.update_current_socket_timeout(self.timeout_s)
        breaker.succeeded()
        with self._lock:
            self._client = client
        self._warned = False
        _log.info("%s: connected to Redis", self._name)
