"""TierConfig: off by default, each bad value refused with the field named and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.kv.config import ConfigError, TierConfig
from workers.config import EngineConfig


def test_off_by_default() -> None:
    assert not EngineConfig().tiers.enabled
    assert TierConfig(dram_mb=64).enabled
    assert TierConfig(nvme_path="/tmp/kv", nvme_mb=10).enabled
    assert TierConfig(redis_url="redis://127.0.0.1:6379/0").enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dram_mb": -1}, "tiers.dram_mb"),
        ({"nvme_path": "/tmp/kv"}, "--nvme-mb"),
        ({"nvme_mb": 10}, "--nvme-path"),
        ({"redis_url": "localhost:6379"}, "redis://"),
        ({"nvme_codec": "zstd"}, "tiers.nvme_codec"),
        ({"dram_cap_mbps": 0}, "tiers.dram_cap_mbps"),
        ({"plan": "sometimes"}, "tiers.plan"),
        ({"redis_timeout_s": 0}, "tiers.redis_timeout_s"),
        ({"redis_read_timeout_s": 0}, "tiers.redis_read_timeout_s"),
        ({"redis_queue_mb": 0}, "tiers.redis_queue_mb"),
        ({"redis_breaker_failures": 0}, "tiers.redis_breaker_failures"),
        ({"tier_key_file": " "}, "--tier-key-file"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        TierConfig(**kwargs)  # type: ignore[arg-type]


def test_redis_password_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHESVC_REDIS_PASSWORD", "s3cret")
    tiers = TierConfig(redis_url="rediss://cache:6380/0")
    config = EngineConfig.from_env(tiers=tiers)
    assert config.tiers.redis_password == "s3cret" and config.tiers.redis_url == tiers.redis_url


def test_engine_flags_build_the_tier_config(tmp_path: object) -> None:
    from cachesvc.app.cli.common import engine_config
    from cachesvc.app.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "hi",
            "--dram-mb",
            "64",
            "--nvme-path",
            str(tmp_path),
            "--redis-url",
            "redis://127.0.0.1:6379/0",
            "--tier-key-file",
            "/run/secrets/tier-key",
        ]
    )
    tiers = engine_config(args).tiers
    assert (tiers.dram_mb, tiers.nvme_path, tiers.nvme_mb) == (64, str(tmp_path), 1024)
    assert tiers.redis_url == "redis://127.0.0.1:6379/0"
    assert tiers.tier_key_file == "/run/secrets/tier-key"
    serve = build_parser().parse_args(["serve", "--redis-url", "redis://127.0.0.1:6379/0"])
    assert not engine_config(serve).tiers.enabled  # serve's --redis-url is the router's index


def test_serve_takes_the_kv_tier_redis_apart_from_the_router_index() -> None:
    from cachesvc.app.cli.main import build_parser
    from cachesvc.app.cli.serve import serve_config

    args = ["serve", "--redis-url", "redis://index:6379/0", "--redis-tier-url", "redis://kv:1/2"]
    config = serve_config(build_parser().parse_args(args))
    assert config.router.redis_url == "redis://index:6379/0"
    assert config.engine.tiers.redis_url == "redis://kv:1/2"


def test_the_tier_key_is_the_file_without_surrounding_whitespace(tmp_path: Path) -> None:
    assert TierConfig().read_key() is None  # no key: checksummed blocks, as before
    key = tmp_path / "key"
    key.write_bytes(b"  " + b"A" * 32 + b"\n")
    assert TierConfig(tier_key_file=str(key)).read_key() == b"A" * 32


@pytest.mark.parametrize("content", [None, b"", b"too short\n", b" " * 40 + b"A" * 31 + b"\n"])
def test_a_missing_or_short_key_says_how_to_make_one(tmp_path: Path, content: bytes | None) -> None:
    key = tmp_path / "key"
    if content is not None:
        key.write_bytes(content)
    config = TierConfig(tier_key_file=str(key))  # read where the engine starts, not here
    with pytest.raises(ConfigError, match=r"tier_key_file.*head -c 32 /dev/urandom \| base64"):
        config.read_key()


def test_quantized_codecs_are_opt_in_per_tier() -> None:
    from cachesvc.kv.config import AUTO_CODECS, QUANTIZED_CODECS

    assert set(QUANTIZED_CODECS) == {"int8", "fp8_e4m3"}
    assert not set(TierConfig().codecs.values()) & set(QUANTIZED_CODECS)  # never by default
    assert not set(AUTO_CODECS) & set(QUANTIZED_CODECS)  # nor through "auto"
    config = TierConfig(dram_codec="int8", redis_codec="fp8_e4m3")
    assert config.codecs == {"dram": "int8", "nvme": "auto", "redis": "fp8_e4m3"}


@pytest.mark.parametrize(
    ("flags", "codecs"),
    [
        ([], {"dram": "raw", "nvme": "auto", "redis": "auto"}),
        (["int8"], {"dram": "int8", "nvme": "int8", "redis": "int8"}),
        (["dram=int8,redis=fp8_e4m3"], {"dram": "int8", "nvme": "auto", "redis": "fp8_e4m3"}),
        (
            ["fp8_e4m3", "--tier-codec", "dram=raw"],
            {"dram": "raw", "nvme": "fp8_e4m3", "redis": "fp8_e4m3"},
        ),
    ],
)
def test_the_tier_codec_flag_sets_the_tiers_it_names(
    flags: list[str], codecs: dict[str, str]
) -> None:
    from cachesvc.app.cli.common import engine_config
    from cachesvc.app.cli.main import build_parser

    argv = ["generate", "--prompt", "hi", *(["--tier-codec", *flags] if flags else [])]
    assert engine_config(build_parser().parse_args(argv)).tiers.codecs == codecs


@pytest.mark.parametrize("value", ["zstd", "hbm=int8", "dram=", "dram=int8=raw"])
def test_a_bad_tier_codec_flag_names_the_flag_and_the_choices(value: str) -> None:
    from cachesvc.app.cli.common import CliError, engine_config
    from cachesvc.app.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--tier-codec", value])
    with pytest.raises(CliError, match=r"--tier-codec.*dram, nvme, redis.*fp8_e4m3"):
        engine_config(args)
