"""`cachesvc serve --admit-ttft-ms/--admit-itl-ms` and `router.admit_ttft_ms/admit_itl_ms`
reach the router's config (off by default), and a target that is not positive is refused
naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config
from cachesvc.app.config_file import load_config_file
from cachesvc.app.serve import ServeConfig
from cachesvc.config import ConfigError


def test_the_flag_reaches_the_router() -> None:
    args = build_parser().parse_args(["serve", "--admit-ttft-ms", "1500"])
    assert serve_config(args).router.admit_ttft_ms == 1500.0
    assert serve_config(build_parser().parse_args(["serve"])).router.admit_ttft_ms is None


def test_the_config_file_sets_it(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("router: {admit_ttft_ms: 750}\n")
    assert load_config_file(path, ServeConfig).router.admit_ttft_ms == 750.0
    path.write_text("router: {admit_ttft_ms: 0}\n")
    with pytest.raises(ConfigError, match="admit_ttft_ms must be positive"):
        load_config_file(path, ServeConfig)


def test_the_streams_target_reaches_the_router(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--admit-itl-ms", "100"])
    assert serve_config(args).router.admit_itl_ms == 100.0
    assert serve_config(build_parser().parse_args(["serve"])).router.admit_itl_ms is None
    path = tmp_path / "serve.yaml"
    path.write_text("router: {admit_itl_ms: 40}\n")
    assert load_config_file(path, ServeConfig).router.admit_itl_ms == 40.0
    path.write_text("router: {admit_itl_ms: -1}\n")
    with pytest.raises(ConfigError, match="admit_itl_ms must be positive"):
        load_config_file(path, ServeConfig)
