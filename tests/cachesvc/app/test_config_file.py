"""cachesvc/app/config_file.py: files onto the frozen config dataclasses, and `serve --config`."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser, main
from cachesvc.app.cli.serve import serve_config, serve_config_file
from cachesvc.app.config_file import (
    changed_fields,
    from_mapping,
    load_config_file,
    read_config_file,
    with_overrides,
)
from cachesvc.app.serve import ServeConfig
from cachesvc.kv.config import ConfigError
from router.tenants import TenantToken
from workers.config import EngineConfig


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    size: int = 1
    ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"size must be positive, got {self.size}")


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    name: str | None = None
    flag: bool = False
    tags: tuple[str, ...] = ()
    pair: tuple[int, str] = (0, "")
    limits: dict[str, int] = field(default_factory=dict)
    color: Color = Color.RED
    folder: Path = Path(".")


def test_mapping_converts_what_a_file_cannot_say() -> None:
    data = {
        "inner": {"size": 3, "ratio": 2},
        "tags": ["a", "b"],
        "pair": [1, "x"],
        "limits": {"a": 1},
        "color": "blue",
        "folder": "/tmp/x",
        "name": None,
    }
    got = from_mapping(Outer, data)
    assert got == Outer(
        inner=Inner(3, 2.0),
        tags=("a", "b"),
        pair=(1, "x"),
        limits={"a": 1},
        color=Color.BLUE,
        folder=Path("/tmp/x"),
    )
    assert isinstance(got.inner.ratio, float)
    assert from_mapping(Outer, {}) == Outer()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inner": {"sise": 2}}, r"unknown key 'inner\.sise'.*did you mean 'size'"),
        ({"zzz": 1}, r"unknown key 'zzz'.*known keys: inner, name"),
        ({"inner": {"size": True}}, r"inner\.size must be an integer, got True"),
        ({"inner": {"size": "2"}}, r"inner\.size must be an integer, got '2'"),
        ({"inner": {"ratio": False}}, r"inner\.ratio must be a number"),
        ({"flag": 1}, r"flag must be true or false"),
        ({"inner": 3}, r"inner must be a mapping of Inner fields"),
        ({"inner": None}, r"inner must not be null"),
        ({"name": 5}, r"name must be a string, got 5"),
        ({"tags": "ab"}, r"tags must be a list"),
        ({"tags": ["a", 1]}, r"tags\[1\] must be a string"),
        ({"pair": [1]}, r"pair must have 2 items"),
        ({"color": "green"}, r"color must be one of \['red', 'blue'\]"),
        ({"inner": {"size": 0}}, r"^inner: size must be positive, got 0$"),
    ],
)
def test_mistakes_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(Outer, data)


def test_serve_config_nests_engine_tiers_and_router() -> None:
    config = from_mapping(
        ServeConfig,
        {"num_workers": 2, "engine": {"tiers": {"dram_mb": 64}}, "router": {"port": 6000}},
    )
    assert config.num_workers == 2 and config.router.port == 6000
    assert config.engine.tiers.dram_mb == 64.0 and config.engine.block_size == 16
    with pytest.raises(ConfigError, match=r"unknown key 'engine\.tiers\.dram_gb'"):
        from_mapping(ServeConfig, {"engine": {"tiers": {"dram_gb": 4}}})


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_files_of_each_format(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"serve{suffix}"
    path.write_text(json.dumps({"engine": {"block_size": 32}}))  # JSON is YAML too
    assert load_config_file(path, ServeConfig).engine.block_size == 32


def test_bad_files_say_which_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert read_config_file(empty) == {}
    for text, message in [("[1, 2]", "must hold a mapping, not list"), ("a: [", "is not valid")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            read_config_file(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_config_file(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text("router:\n  prot: 1\n")
    with pytest.raises(ConfigError, match=rf"^{typo}: unknown key 'router\.prot'"):
        load_config_file(typo, ServeConfig)


def test_overrides_and_changed_fields_round_trip() -> None:
    base = ServeConfig(engine=EngineConfig(), router=from_mapping(ServeConfig, {}).router)
    changed = with_overrides(base, {"router.port": 7000, "engine.tiers.dram_mb": 8.0})
    assert changed.router.port == 7000 and changed.engine.tiers.dram_mb == 8.0
    assert changed_fields(changed, base) == {"router.port": 7000, "engine.tiers.dram_mb": 8.0}
    with pytest.raises(ConfigError, match="no field 'prot'"):
        with_overrides(base, {"router.prot": 1})
    with pytest.raises(ConfigError, match="port must be in"):
        with_overrides(base, {"router.port": -1})


def test_serve_config_flag_overrides_the_file_only_when_given(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_workers: 3\nrouter: {port: 6000, policy: round_robin}\n")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = ["serve", "--port", "7000", "--auth-token-file", str(token), "--config", str(path)]
    args = build_parser().parse_args(argv)
    config = serve_config_file(args.config, serve_config(args))
    assert config.router.port == 7000  # given on the command line
    assert config.router.policy == "round_robin" and config.num_workers == 3  # from the file
    assert config.router.auth_token == "s3cret"


def test_serve_tls_and_tenants_from_the_file_and_from_the_flags(tmp_path: Path) -> None:
    for name in ("a.crt", "a.key", "b.crt", "b.key"):
        (tmp_path / name).write_text("-----BEGIN X-----\n-----END X-----\n")
    a_crt, a_key, b_crt, b_key = (str(tmp_path / n) for n in ("a.crt", "a.key", "b.crt", "b.key"))
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"router:\n  tls_cert_file: {a_crt}\n  tls_key_file: {a_key}\n"
        "  tenant_tokens:\n    - {tenant: acme, token: t1}\n"
    )
    router = load_config_file(path, ServeConfig).router
    assert (router.tls_cert_file, router.tls_key_file) == (a_crt, a_key)
    assert router.tenant_tokens == (TenantToken("acme", "t1"),)

    path.write_text("router: {port: 6000}\n")  # no TLS in the file: the flags add both files
    tenants = tmp_path / "tenants"
    tenants.write_text("umbrella t2\n")
    argv = ["serve", "--tls-cert-file", b_crt, "--tls-key-file", b_key, "--config", str(path)]
    args = build_parser().parse_args([*argv, "--tenant-tokens-file", str(tenants)])
    router = serve_config_file(args.config, serve_config(args)).router
    assert (router.tls_cert_file, router.tls_key_file, router.port) == (b_crt, b_key, 6000)
    assert router.tenant_tokens == (TenantToken("umbrella", "t2"),)


def test_serve_with_a_bad_config_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  blok_size: 32\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown key 'engine.blok_size'" in err and "did you mean 'block_size'" in err


def test_serve_peer_pull_from_the_flag_or_the_file(tmp_path: Path) -> None:
    assert not serve_config(build_parser().parse_args(["serve"])).engine.peer_pull
    assert serve_config(build_parser().parse_args(["serve", "--peer-pull"])).engine.peer_pull
    path = tmp_path / "serve.yaml"
    path.write_text(
        "engine: {peer_pull: true, peer_pull_timeout_s: 2.5}\nrouter: {peer_pull: true}\n"
    )
    args = build_parser().parse_args(["serve", "--config", str(path)])
    config = serve_config_file(args.config, serve_config(args))
    assert config.engine.peer_pull and config.engine.peer_pull_timeout_s == 2.5
    assert config.router.peer_pull
