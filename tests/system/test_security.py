"""TLS, mutual TLS and tenant tokens on a real router over real Ray workers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cachesvc.app.cli.main import main
from cachesvc.kv.config import ConfigError
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.config import ServerTls
from router.grpc.client import ClientTls, RemoteError, RemoteSampling, RouterClient
from router.grpc.server import listen
from router.tenants import TenantToken

pytestmark = pytest.mark.system
HEALTHCHECK = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"
SAMPLING = RemoteSampling(
    max_tokens=3, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=(), n=1, ignore_eos=True
)


@dataclass(frozen=True)
class Pki:
    """PEM files of a test CA, a server certificate for localhost / 127.0.0.1 and a client
    certificate, all signed by the CA, plus a second CA that signed none of them."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: Any, issuer: tuple[str, Any] | None, **kind: bool) -> Any:
    """A certificate for `key`, signed by `issuer` (name, key) or by itself; `ca`, `server`
    or `client` says what it is for."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=kind.get("ca", False), path_length=None), True)
    )
    if kind.get("server"):
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if kind.get("client"):
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: Any = None, key: Any = None) -> Path:
    from cryptography.hazmat.primitives import serialization

    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca_key, server_key, client_key, other_key = _key(), _key(), _key(), _key()
    ca = ("cachesvc test CA", ca_key)
    return Pki(
        ca=_write(folder / "ca.pem", _cert(ca[0], ca_key, None, ca=True)),
        server_cert=_write(folder / "server.pem", _cert("localhost", server_key, ca, server=True)),
        server_key=_write(folder / "server.key", key=server_key),
        client_cert=_write(folder / "client.pem", _cert("client", client_key, ca, client=True)),
        client_key=_write(folder / "client.key", key=client_key),
        other_ca=_write(folder / "other.pem", _cert("other CA", other_key, None, ca=True)),
    )


def _secure(address: str, ca: Path) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes()))


def _tokenize_code(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        pb_grpc.InferenceStub(channel).Tokenize(
            pb.TokenizeRequest(prompt=pb.Prompt(text="hi")), timeout=10
        )
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return, attr-defined]
    return grpc.StatusCode.OK


def test_tls_streams_to_a_trusting_client_and_only_to_it(
    make_server: Any, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    server = make_server(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    request = pb.GenerateRequest(
        prompt=pb.Prompt(text="The quick brown fox over TLS"),
        sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    with _secure(server.address, pki.ca) as channel:
        messages = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert len(messages) > 1, "tokens must stream over TLS too"
    assert sum(len(m.token_ids) for m in messages) == 6
    assert messages[-1].finish_reason == "length"

    with grpc.insecure_channel(server.address) as plain:
        assert _tokenize_code(plain) == grpc.StatusCode.UNAVAILABLE
    with _secure(server.address, pki.other_ca) as untrusting:
        assert _tokenize_code(untrusting) == grpc.StatusCode.UNAVAILABLE

    argv = ["generate", "--server", server.address, "--tls-ca-file", str(pki.ca), "--json"]
    assert main([*argv, "--prompt", "hello", "--max-tokens", "3", "--ignore-eos"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert len(json.loads(line)["token_ids"]) == 3


def test_mutual_tls_requires_a_client_certificate(make_server: Any, pki: Pki) -> None:
    server = make_server(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
    )
    ca = pki.ca.read_bytes()
    identified = ClientTls(ca, pki.client_cert.read_bytes(), pki.client_key.read_bytes())
    with RouterClient(server.address, tls=identified) as client:
        (out,) = client.generate("hello over mutual TLS", SAMPLING)
    assert len(out["token_ids"]) == 3

    anonymous = ClientTls(ca)
    with RouterClient(server.address, tls=anonymous) as client, pytest.raises(RemoteError) as err:
        client.generate("hello", SAMPLING)
    assert "UNAVAILABLE" in str(err.value)


def test_the_health_port_answers_probes_in_plaintext_and_serves_nothing_else(
    make_server: Any, pki: Pki
) -> None:
    server = make_server(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
        auth_token="operator-tok",
        health_port=0,
    )
    health = f"127.0.0.1:{server.server.health_port}"
    probe = [sys.executable, str(HEALTHCHECK), health]
    for service in ("", "cachesvc.v1.Admin", "cachesvc.v1.Inference"):
        done = subprocess.run([*probe, service], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    with grpc.insecure_channel(health) as plain:
        assert _tokenize_code(plain) == grpc.StatusCode.UNIMPLEMENTED  # health only
    with grpc.insecure_channel(server.address) as plain:  # the main port still needs mTLS
        assert _tokenize_code(plain) == grpc.StatusCode.UNAVAILABLE


def test_tenant_tokens_isolate_caches(make_server: Any) -> None:
    tenants = (
        TenantToken("acme", "acme-tok"),
        TenantToken("umbrella", "umbrella-tok"),
        TenantToken("acme", "acme-tok-2"),
    )
    server = make_server(auth_token="operator-tok", tenant_tokens=tenants)
    stub = pb_grpc.InferenceStub(server.channel())
    text = "A shared system prompt is cached once and reused by every tenant that asks, or not."
    prompt = pb.Prompt(text=text)
    operator = [("authorization", "Bearer operator-tok")]
    num_ids = len(stub.Tokenize(pb.TokenizeRequest(prompt=prompt), metadata=operator).token_ids)

    def cached(token: str, salt: str | None = None) -> int:
        request = pb.GenerateRequest(
            prompt=prompt, sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True)
        )
        if salt is not None:
            request.cache_salt = salt
        metadata = [("authorization", f"Bearer {token}")]
        messages = list(stub.Generate(request, metadata=metadata, timeout=60))
        return sum(messages[-1].usage.cached_tokens.values())

    assert cached("acme-tok") == 0
    assert cached("acme-tok") >= num_ids - 4, "a tenant's repeat should hit its own cache"
    assert cached("acme-tok-2") >= num_ids - 4, "tokens of one tenant share its cache"
    assert cached("umbrella-tok") == 0, "umbrella must not see acme's blocks"
    assert cached("acme-tok", salt="team-1") == 0, "a request's salt splits a tenant's cache"
    assert cached("operator-tok") == 0, "the operator's token is no tenant"

    request = pb.GenerateRequest(prompt=prompt, cache_salt="tenant:acme")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, metadata=operator, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in err.value.details()

    admin = pb_grpc.AdminStub(server.channel())
    assert admin.Stats(pb.StatsRequest(), metadata=operator).policy == "prefix_aware"
    with pytest.raises(grpc.RpcError) as err:
        admin.Flush(pb.FlushRequest(), metadata=[("authorization", "Bearer acme-tok")])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_key_that_is_not_the_certificates_is_a_config_error(pki: Pki) -> None:
    tls = ServerTls(pki.server_cert.read_bytes(), pki.client_key.read_bytes())

    async def bind() -> None:
        server = grpc.aio.server()
        try:
            listen(server, "127.0.0.1:0", tls)
        finally:
            await server.stop(None)

    with pytest.raises(ConfigError, match="tls_key_file is not the unencrypted PEM private key"):
        asyncio.run(bind())
