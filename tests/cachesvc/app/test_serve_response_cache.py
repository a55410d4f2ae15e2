"""`cachesvc serve`'s response-cache settings: flags, the config file, the signing key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config, serve_config_file
from cachesvc.kv.config import ConfigError
from router.config import RouterConfig


def _key(tmp_path: Path, name: str, text: str = "k" * 32) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def test_the_flags_reach_the_router_config(tmp_path: Path) -> None:
    key = _key(tmp_path, "response.key")
    argv = ["serve", "--response-cache-redis-url", "redis://cache:6380/0"]
    argv += ["--response-cache-key-file", key, "--response-cache-timeout-s", "0.02"]
    argv += ["--response-cache-max-entry-kb", "64"]
    router = serve_config(build_parser().parse_args(argv)).router
    assert router.response_cache_redis_url == "redis://cache:6380/0"
    assert router.response_cache_key_file == key
    assert router.response_cache_timeout_s == 0.02
    assert router.response_cache_max_entry_kb == 64
    assert router.read_response_cache_key() == b"k" * 32


def test_the_tier_key_signs_answers_unless_they_have_their_own(tmp_path: Path) -> None:
    tier, own = _key(tmp_path, "tier.key"), _key(tmp_path, "own.key")
    args = build_parser().parse_args(["serve", "--tier-key-file", tier])
    assert serve_config(args).router.response_cache_key_file == tier
    args = build_parser().parse_args(
        ["serve", "--tier-key-file", tier, "--response-cache-key-file", own]
    )
    assert serve_config(args).router.response_cache_key_file == own
    # A config file that names only the tier key: the same rule.
    path = tmp_path / "serve.yaml"
    path.write_text(f"engine:\n  tiers:\n    tier_key_file: {tier}\n")
    args = build_parser().parse_args(["serve", "--config", str(path)])
    assert serve_config_file(args.config, serve_config(args)).router.response_cache_key_file == tier
    path.write_text(
        f"engine:\n  tiers:\n    tier_key_file: {tier}\n"
        f"router:\n  response_cache_key_file: {own}\n  response_cache_queue_entries: 8\n"
    )
    router = serve_config_file(args.config, serve_config(args)).router
    assert router.response_cache_key_file == own and router.response_cache_queue_entries == 8


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_cache_timeout_s": 0}, "response_cache_timeout_s must be positive"),
        ({"response_cache_max_entry_kb": -1}, "response_cache_max_entry_kb must be positive"),
        ({"response_cache_queue_entries": 0}, "response_cache_queue_entries must be positive"),
        ({"response_cache_redis_url": "cache:6380"}, "redis://host:port/db"),
        ({"response_cache_key_file": " "}, "must name a file"),
    ],
)
def test_bad_settings_say_which(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**fields)  # type: ignore[arg-type]


def test_a_short_or_missing_key_says_how_to_make_one(tmp_path: Path) -> None:
    short = RouterConfig(response_cache_key_file=_key(tmp_path, "short.key", "k" * 31))
    with pytest.raises(ConfigError, match="holds 31 bytes.*head -c 32 /dev/urandom"):
        short.read_response_cache_key()
    missing = RouterConfig(response_cache_key_file=str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match="cannot read"):
        missing.read_response_cache_key()
    assert RouterConfig().read_response_cache_key() is None
