"""The gRPC edge: proto <-> router types, status codes, health and reflection.

Servicers translate and delegate to `router.core.Router`; they decide nothing. Inference is
here, Cache and Admin in `cache_service.py` and `admin_service.py`; what they share (lenient
parsing, status codes, the caller's tenant) in `calls.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cachesvc.kv.config import ConfigError
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.auth import BearerTokenInterceptor, TokenTable, tenant_cache_salt
from router.config import RouterConfig, ServerTls
from router.core import Router
from router.grpc import wire
from router.grpc.admin_service import AdminService
from router.grpc.cache_service import CacheService
from router.grpc.calls import caller_tenant, decoded, fail, lenient, status_of, unary
from router.metrics import MetricsHttpServer

_log = logging.getLogger(__name__)

INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = pb.DESCRIPTOR.services_by_name["Admin"].full_name
CACHE = pb.DESCRIPTOR.services_by_name["Cache"].full_name


class InferenceService:
    """cachesvc.v1.Inference. A call made with a tenant's token gets that tenant's cache: its
    salt is `tenant_cache_salt` of the tenant and the request's salt."""

    def __init__(self, router: Router, config: RouterConfig, tokens: TokenTable | None) -> None:
        self._router = router
        self._config = config
        self._tokens = tokens

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        return caller_tenant(self._tokens, context)

    async def generate(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        msg: pb.GenerateRequest = await decoded(request, context)
        code: grpc.StatusCode | None = grpc.StatusCode.OK  # None: counted already
        try:
            req = wire.generate_from_proto(msg, self._config)
            tenant = self._tenant(context)
            salt = tenant_cache_salt(tenant, req.cache_salt)
            req = dataclasses.replace(req, cache_salt=salt, tenant=tenant or "")
            if not req.request_id:
                req = dataclasses.replace(req, request_id=f"req-{uuid.uuid4().hex[:16]}")
            async with contextlib.aclosing(self._router.generate(req)) as deltas:
                async for delta in deltas:
                    yield wire.delta_to_proto(req.request_id, delta)
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            # Counted before the abort, as Score and Tokenize do: the client has the status as
            # soon as the call is aborted, and may read the metrics next.
            self._count("Generate", status_of(exc))
            code = None
            await fail(context, exc)
        finally:
            if code is not None:
                self._count("Generate", code)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self._router.metrics.requests.labels("grpc", method, code.name).inc()

    async def score(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        msg: pb.ScoreRequest = await decoded(request, context)
        try:
            req = wire.score_from_proto(msg)
            salt = tenant_cache_salt(self._tenant(context), req.cache_salt)
            result = await self._router.score(dataclasses.replace(req, cache_salt=salt))
        except Exception as exc:
            self._count("Score", status_of(exc))
            await fail(context, exc)
        self._count("Score", grpc.StatusCode.OK)
        return wire.score_to_proto(result)

    async def tokenize(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        msg: pb.TokenizeRequest = await decoded(request, context)
        try:
            prompt = wire.prompt_from_proto(msg.prompt)
            ids, num_blocks, text = await self._router.tokenize(prompt, msg.continuation)
        except Exception as exc:
            self._count("Tokenize", status_of(exc))
            await fail(context, exc)
        self._count("Tokenize", grpc.StatusCode.OK)
        return pb.TokenizeResponse(token_ids=ids, num_blocks=num_blocks, text=text)


def _handlers(
    router: Router, config: RouterConfig, tokens: TokenTable | None
) -> list[grpc.GenericRpcHandler]:
    inference = InferenceService(router, config, tokens)
    admin = AdminService(router)
    cache = CacheService(router, tokens)
    return [
        grpc.method_handlers_generic_handler(
            INFERENCE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    inference.generate,
                    request_deserializer=lenient(pb.GenerateRequest),
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
                "Score": unary(inference.score, pb.ScoreRequest, pb.ScoreResponse),
                "Tokenize": unary(inference.tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
            },
        ),
        grpc.method_handlers_generic_handler(
            ADMIN,
            {
                "ListWorkers": unary(
                    admin.list_workers, pb.ListWorkersRequest, pb.ListWorkersResponse
                ),
                "Stats": unary(admin.stats, pb.StatsRequest, pb.StatsResponse),
                "Flush": unary(admin.flush, pb.FlushRequest, pb.FlushResponse),
                "Purge": unary(admin.purge, pb.PurgeRequest, pb.PurgeResponse),
                "SetTenantQuota": unary(
                    admin.set_tenant_quota, pb.SetTenantQuotaRequest, pb.SetTenantQuotaResponse
                ),
                "TenantUsage": unary(
                    admin.tenant_usage, pb.TenantUsageRequest, pb.TenantUsageResponse
                ),
            },
        ),
        grpc.method_handlers_generic_handler(
            CACHE,
            {
                "Prewarm": unary(cache.prewarm, pb.PrewarmRequest, pb.PrewarmResponse),
                "CloseSession": unary(
                    cache.close_session, pb.CloseSessionRequest, pb.CloseSessionResponse
                ),
            },
        ),
    ]


class RouterServer:
    """A grpc.aio server around a started Router, with health checking and reflection; over
    TLS when the config has a certificate (reads the TLS files once, here)."""

    def __init__(self, router: Router, config: RouterConfig) -> None:
        tokens = TokenTable.from_config(config)
        interceptors = [] if tokens is None else [BearerTokenInterceptor(tokens)]
        self.server = grpc.aio.server(interceptors=interceptors)
        self.server.add_generic_rpc_handlers(_handlers(router, config, tokens))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (INFERENCE, ADMIN, CACHE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = listen(self.server, f"{config.host}:{config.port}", config.read_tls())
        # The health service alone, plaintext and loopback only: probes in the pod use it when
        # the main port speaks TLS (a health check reveals no data and needs no token).
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if config.health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = listen(self.health_server, f"127.0.0.1:{config.health_port}", None)
        self._router = router
        self._watch: asyncio.Task[None] | None = None
        self._metrics_port = config.metrics_port
        self.metrics: MetricsHttpServer | None = None

    async def start(self) -> None:
        """Start serving gRPC, and Prometheus metrics when a metrics port is configured."""
        port, registry = self._metrics_port, self._router.metrics.registry
        if port is not None:
            self.metrics = MetricsHttpServer(registry, self._router.config.host, port)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self._publish_health()
        self._watch = asyncio.get_running_loop().create_task(self._watch_health())

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, let running calls finish for `grace_s`, then stop."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.metrics is not None:
            self.metrics.close()

    async def _publish_health(self) -> None:
        serving = self._router.is_serving()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", INFERENCE, CACHE):
            await self.health.set(name, status)
        await self.health.set(ADMIN, health_pb2.HealthCheckResponse.SERVING)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self._publish_health()


def listen(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Add the listening port (TLS when `tls` is given) to `server`; the port bound."""
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.private_key, tls.cert_chain)],
            root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        try:
            port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            # grpc says only "Failed to bind" when it cannot use the key, as for a taken port.
            raise ConfigError(
                f"cannot listen on {address} with TLS: the address is taken, or tls_key_file "
                "is not the unencrypted PEM private key of the certificate in tls_cert_file"
            ) from exc
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port
