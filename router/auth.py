"""Bearer-token authentication for every RPC except health checks, and the tenant it names.

With tokens configured (`RouterConfig.auth_token`, `RouterConfig.tenant_tokens`), a call needs
the metadata `authorization: Bearer <token>` with one of them; anything else ends with
UNAUTHENTICATED before the servicer runs. Health checks stay open so load balancers and
orchestrators can probe without a secret. The Admin service acts on every tenant's cache
(Flush), so a tenant's token gets PERMISSION_DENIED there: it is the operator's (`auth_token`).
The servicer asks the same `TokenTable` which tenant a call is, and isolates its cache with
`tenant_cache_salt`.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cachesvc.kv.hashing import PURGE_SALT_PREFIX
from router.config import RouterConfig
from router.domain import InvalidInput
from router.tenants import TenantToken

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
OPERATOR_METHOD_PREFIXES = ("/cachesvc.v1.Admin/",)
TENANT_SALT_PREFIX = "tenant:"
_DENIED = "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'"
_OPERATOR_ONLY = (
    "the Admin service acts on every tenant's cache: call it with the operator's token "
    "(the router's --auth-token-file), not a tenant's"
)
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class Caller:
    """Who a call's bearer token says it is."""

    # None: the operator's token (`auth_token`), or a router without authentication.
    tenant: str | None


def parse_bearer(value: str | bytes | None) -> str | None:
    """The token in an `authorization` value such as "Bearer abc"; None if absent or another
    scheme. The scheme is case-insensitive (RFC 7235); the token is not."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def bearer_token(metadata: Metadata | None) -> str | None:
    """The bearer token of the first `authorization` entry; later entries are ignored."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return parse_bearer(value)
    return None


def tenant_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a call's blocks are hashed with, for routing and in the workers alike.

    A tenant's calls get `tenant:<tenant>`, or `tenant:<tenant>/<cache_salt>` when the request
    has a salt: tenants never share blocks, a tenant's requests of the same salt do, and since
    tenant names have no "/", no two (tenant, salt) pairs meet. Without a tenant the request's
    salt is kept as it is, but one starting with "tenant:" is refused (InvalidInput): it would
    reach a tenant's blocks, on this router or through a Redis tier that routers share. So is
    one starting with "purge:", which would reach blocks of another purge epoch
    (`cachesvc.kv.hashing.epoch_salt`).
    """
    if tenant is None:
        for prefix, owner in ((TENANT_SALT_PREFIX, "tenants'"), (PURGE_SALT_PREFIX, "purged")):
            if cache_salt is not None and cache_salt.startswith(prefix):
                raise InvalidInput(
                    f"cache_salt must not start with {prefix!r}: that prefix is reserved for "
                    f"{owner} caches"
                )
        return cache_salt
    base = TENANT_SALT_PREFIX + tenant
    return f"{base}/{cache_salt}" if cache_salt else base


class TokenTable:
    """The known bearer tokens and whose they are; immutable."""

    def __init__(self, auth_token: str | None, tenant_tokens: Sequence[TenantToken] = ()) -> None:
        self._entries = [] if auth_token is None else [(auth_token.encode(), Caller(None))]
        self._entries += [(t.token.encode(), Caller(t.tenant)) for t in tenant_tokens]
        if not self._entries:
            raise ValueError("no tokens: a gate without tokens shuts everyone out; omit it")
        if any(not token for token, _ in self._entries):
            raise ValueError("an empty bearer token would let anyone in")

    @classmethod
    def from_config(cls, config: RouterConfig) -> TokenTable | None:
        """The config's tokens; None when it has none (authentication off)."""
        if config.auth_token is None and not config.tenant_tokens:
            return None
        return cls(config.auth_token, config.tenant_tokens)

    def caller(self, metadata: Metadata | None) -> Caller | None:
        """The caller whose token the metadata carries; None for no or an unknown token.

        Every known token is compared, in constant time, so the time taken says nothing about
        how much of a guess matched, nor which entry did.
        """
        token = bearer_token(metadata)
        if token is None:
            return None
        sent, found = token.encode(), None
        for known, caller in self._entries:
            if hmac.compare_digest(sent, known):
                found = caller
        return found


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects calls without a known bearer token (health checks excepted), and tenants' calls
    to operator methods."""

    def __init__(
        self,
        tokens: TokenTable,
        open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES,
        operator_prefixes: Sequence[str] = OPERATOR_METHOD_PREFIXES,
    ) -> None:
        self._tokens = tokens
        self._open = tuple(open_prefixes)
        self._operator = tuple(operator_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        caller = self._tokens.caller(handler_call_details.invocation_metadata)
        if caller is None:
            code, details = grpc.StatusCode.UNAUTHENTICATED, _DENIED
        elif caller.tenant is not None and method.startswith(self._operator):
            code, details = grpc.StatusCode.PERMISSION_DENIED, _OPERATOR_ONLY
        else:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _denying(handler, code, details)


def _denying(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only ends with `code`."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
