"""Bearer tokens, tenants and their cache salts, TLS settings; the interceptor on a real server."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from cachesvc.kv.config import ConfigError
from router.auth import BearerTokenInterceptor, TokenTable, parse_bearer, tenant_cache_salt
from router.config import RouterConfig
from router.domain import InvalidInput
from router.tenants import TenantToken, load_tenant_tokens, parse_tenant_tokens

TENANTS = (TenantToken("acme", "acme-tok"), TenantToken("umbrella", "umb-tok"))
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
        (b"Bearer abc", "abc"),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic abc", None),
        ("abc", None),
        ("Bearer a b", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_bearer(value: str | bytes | None, token: str | None) -> None:
    assert parse_bearer(value) == token


@pytest.mark.parametrize(
    ("metadata", "tenant"),
    [
        ([("authorization", "Bearer s3cret")], None),
        ([("Authorization", "Bearer s3cret")], None),
        ([("x-other", "1"), ("authorization", "Bearer s3cret")], None),
        ([("authorization", "Bearer acme-tok")], "acme"),
        ([("authorization", "Bearer umb-tok")], "umbrella"),
    ],
)
def test_known_tokens_name_their_caller(
    metadata: list[tuple[str, str]], tenant: str | None
) -> None:
    caller = TokenTable("s3cret", TENANTS).caller(metadata)
    assert caller is not None and caller.tenant == tenant


@pytest.mark.parametrize(
    "metadata",
    [
        [("authorization", "Bearer S3CRET")],  # tokens are case-sensitive
        [("authorization", "Bearer s3cret-and-more")],
        [("authorization", "Bearer acme")],  # a tenant's name is not its token
        [("authorization", "Basic s3cret")],
        [("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")],
        [("x-token", "s3cret")],
        [],
        None,
    ],
)
def test_unknown_tokens_name_nobody(metadata: list[tuple[str, str]] | None) -> None:
    assert TokenTable("s3cret", TENANTS).caller(metadata) is None


def test_token_table_needs_tokens() -> None:
    with pytest.raises(ValueError, match="empty"):
        TokenTable("")
    with pytest.raises(ValueError, match="no tokens"):
        TokenTable(None, ())
    assert TokenTable.from_config(RouterConfig()) is None
    tenants_only = TokenTable.from_config(RouterConfig(tenant_tokens=TENANTS))
    assert tenants_only is not None
    assert tenants_only.caller([("authorization", "Bearer s3cret")]) is None


@pytest.mark.parametrize(
    ("tenant", "salt", "effective"),
    [
        (None, None, None),  # no tenant: the request's salt, as before tenants
        (None, "", ""),
        (None, "team-1", "team-1"),
        (None, "tenants:x", "tenants:x"),
        ("acme", None, "tenant:acme"),
        ("acme", "", "tenant:acme"),  # an empty salt is no salt, as in the workers
        ("acme", "team-1", "tenant:acme/team-1"),
        ("acme", "tenant:umbrella", "tenant:acme/tenant:umbrella"),
        ("acme.eu", "a/b", "tenant:acme.eu/a/b"),
    ],
)
def test_tenant_cache_salt(tenant: str | None, salt: str | None, effective: str | None) -> None:
    assert tenant_cache_salt(tenant, salt) == effective


def test_tenant_salts_never_meet() -> None:
    cases = [(t, s) for t in ("a", "a.b", "b", "a-b") for s in (None, "b", "x/y", "a", "tenant:a")]
    salts = [tenant_cache_salt(t, s) for t, s in cases]
    assert len(set(salts)) == len(salts)
    assert not set(salts) & {tenant_cache_salt(None, s) for s in ("b", "x/y", "a")}


def test_without_a_tenant_the_tenant_prefix_is_refused() -> None:
    with pytest.raises(InvalidInput, match="cache_salt must not start with 'tenant:'"):
        tenant_cache_salt(None, "tenant:acme")


def test_parse_tenant_tokens_skips_comments_and_blank_lines() -> None:
    text = "# tenants\n\nacme  acme-tok\n  umbrella\tumb-tok  \n# acme old-tok\nacme acme-tok-2\n"
    assert parse_tenant_tokens(text, "f") == (
        TenantToken("acme", "acme-tok"),
        TenantToken("umbrella", "umb-tok"),
        TenantToken("acme", "acme-tok-2"),  # a tenant may have several tokens (rotation)
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("acme\n", r"f line 1: expected 'TENANT TOKEN' \(two fields, then optional"),
        ("# x\nacme tok extra\n", "f line 2: field 3 is not key=value"),
        ("\nac/me tok\n", r"f line 2: tenant name 'ac/me' must be 1-64 characters"),
        ("a" * 65 + " tok\n", "f line 1: tenant name 'a{65}' must be 1-64"),
        ("acme tök\n", "f line 1: the token of tenant 'acme' must be printable ASCII"),
        (
            "acme tok\n\numbrella tok\n",
            r"f line 3: tenant 'umbrella' has the token of tenant 'acme' \(line 1\)",
        ),
    ],
)
def test_parse_tenant_tokens_errors_name_the_line(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=f"^{error}") as err:
        parse_tenant_tokens(text, "f")
    assert "tok " not in str(err.value) and "tök" not in str(err.value), "never echo a token"


def test_load_tenant_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tenants"
    path.write_text("acme acme-tok\n")
    assert load_tenant_tokens(path) == (TenantToken("acme", "acme-tok"),)
    path.write_text("# nobody yet\n")
    with pytest.raises(ConfigError, match="has no tenants"):
        load_tenant_tokens(path)
    with pytest.raises(ConfigError, match="--tenant-tokens-file: cannot read"):
        load_tenant_tokens(tmp_path / "missing")


def test_config_tokens_are_unique_and_hidden() -> None:
    with pytest.raises(ConfigError, match=r"tenant_tokens\[1\]: tenant 'umbrella' has the token"):
        RouterConfig(tenant_tokens=(TenantToken("acme", "t"), TenantToken("umbrella", "t")))
    with pytest.raises(ConfigError, match="has the token of auth_token"):
        RouterConfig(auth_token="t", tenant_tokens=(TenantToken("acme", "t"),))
    with pytest.raises(ConfigError, match=r"tenant_tokens\[0\]: tenant name 'a b'"):
        RouterConfig(tenant_tokens=(TenantToken("a b", "t"),))
    config = RouterConfig(auth_token="op-secret", tenant_tokens=TENANTS)
    assert "op-secret" not in repr(config) and "acme-tok" not in repr(config)
    assert hash(config) == hash(RouterConfig(auth_token="op-secret", tenant_tokens=TENANTS))


def _pem_files(tmp_path: Path) -> tuple[str, str, str]:
    paths = [tmp_path / name for name in ("cert.pem", "key.pem", "ca.pem")]
    for path in paths:
        path.write_bytes(PEM)
    return str(paths[0]), str(paths[1]), str(paths[2])


def test_tls_config_reads_the_files(tmp_path: Path) -> None:
    cert, key, ca = _pem_files(tmp_path)
    assert RouterConfig().read_tls() is None
    tls = RouterConfig(tls_cert_file=cert, tls_key_file=key).read_tls()
    assert tls is not None and tls.cert_chain == PEM and tls.client_ca is None
    mutual = RouterConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=ca).read_tls()
    assert mutual is not None and mutual.client_ca == PEM


def test_tls_config_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    cert, key, ca = _pem_files(tmp_path)
    cases: Sequence[tuple[dict[str, str], str]] = [
        ({"tls_cert_file": cert}, "tls_cert_file is set but tls_key_file is not: .*--tls-key-file"),
        ({"tls_key_file": key}, "tls_key_file is set but tls_cert_file is not"),
        ({"tls_client_ca_file": ca}, "tls_client_ca_file needs tls_cert_file and tls_key_file"),
        (
            {"tls_cert_file": str(tmp_path / "nope.pem"), "tls_key_file": key},
            r"tls_cert_file: no such file .*nope\.pem.*\(--tls-cert-file\)",
        ),
        (
            {"tls_cert_file": cert, "tls_key_file": str(tmp_path)},
            "tls_key_file: no such file",
        ),
    ]
    for fields, error in cases:
        with pytest.raises(ConfigError, match=error):
            RouterConfig(**fields)  # type: ignore[arg-type]
    Path(key).write_text("not a key")
    with pytest.raises(ConfigError, match=r"tls_key_file: .* is not PEM"):
        RouterConfig(tls_cert_file=cert, tls_key_file=key)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_tls_config_unreadable_file(tmp_path: Path) -> None:
    cert, key, _ = _pem_files(tmp_path)
    os.chmod(key, 0)
    with pytest.raises(ConfigError, match="tls_key_file: .* not readable by this user"):
        RouterConfig(tls_cert_file=cert, tls_key_file=key)


def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _codes(table: TokenTable, calls: list[tuple[str, str | None]]) -> list[grpc.StatusCode]:
    """Start a real grpc.aio server with the interceptor; make each (method, token) call."""
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(table)])
    methods = {
        "/cachesvc.v1.Inference/Tokenize",
        "/cachesvc.v1.Admin/Stats",
        "/grpc.health.v1.Health/Check",
    }
    for method in methods:
        service, name = method.strip("/").split("/")
        handler = grpc.unary_unary_rpc_method_handler(_echo)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, {name: handler})]
        )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, token in calls:
                metadata = [] if token is None else [("authorization", f"Bearer {token}")]
                call = channel.unary_unary(method)(b"x", metadata=metadata, timeout=10)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call
                codes.append(await call.code())
    finally:
        await server.stop(None)
    return codes


def test_interceptor_admits_every_known_token_and_only_them() -> None:
    inference, admin, health = (
        "/cachesvc.v1.Inference/Tokenize",
        "/cachesvc.v1.Admin/Stats",
        "/grpc.health.v1.Health/Check",
    )
    ok, unauthenticated, denied = (
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    )
    expected = [
        ((inference, "s3cret"), ok),
        ((inference, "acme-tok"), ok),
        ((inference, "umb-tok"), ok),
        ((inference, "acme"), unauthenticated),
        ((inference, "wrong"), unauthenticated),
        ((inference, None), unauthenticated),
        ((admin, "s3cret"), ok),
        ((admin, "acme-tok"), denied),  # Admin.Flush would drop every tenant's cache
        ((admin, "wrong"), unauthenticated),
        ((health, None), ok),
    ]
    codes = asyncio.run(_codes(TokenTable("s3cret", TENANTS), [call for call, _ in expected]))
    assert codes == [code for _, code in expected]


@pytest.mark.parametrize("field", ["metrics_port", "health_port"])
def test_side_ports_out_of_range_name_their_field(field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field} must be in"):
        RouterConfig(**{field: 70000})  # type: ignore[arg-type]
    assert getattr(RouterConfig(**{field: 0}), field) == 0  # type: ignore[arg-type]
