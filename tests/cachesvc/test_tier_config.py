"""TierConfig: off by default, each bad value refused with the field named and the fix."""

from __future__ import annotations

import pytest

from cachesvc.config import ConfigError, EngineConfig, TierConfig


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
        ]
    )
    tiers = engine_config(args).tiers
    assert (tiers.dram_mb, tiers.nvme_path, tiers.nvme_mb) == (64, str(tmp_path), 1024)
    assert tiers.redis_url == "redis://127.0.0.1:6379/0"
    serve = build_parser().parse_args(["serve", "--redis-url", "redis://127.0.0.1:6379/0"])
    assert not engine_config(serve).tiers.enabled  # serve's --redis-url is the router's index


def test_serve_takes_the_kv_tier_redis_apart_from_the_router_index() -> None:
    from cachesvc.app.cli.main import build_parser
    from cachesvc.app.cli.serve import serve_config

    args = ["serve", "--redis-url", "redis://index:6379/0", "--redis-tier-url", "redis://kv:1/2"]
    config = serve_config(build_parser().parse_args(args))
    assert config.router.redis_url == "redis://index:6379/0"
    assert config.engine.tiers.redis_url == "redis://kv:1/2"
