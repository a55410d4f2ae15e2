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
from cachesvc.kv.config import ConfigError

SETTINGS = ["admit_ttft_ms", "admit_itl_ms"]


@pytest.mark.parametrize("name", SETTINGS)
def test_the_flag_reaches_the_router(name: str) -> None:
    args = build_parser().parse_args(["serve", f"--{name.replace('_', '-')}", "1500"])
    assert getattr(serve_config(args).router, name) == 1500.0
    assert getattr(serve_config(build_parser().parse_args(["serve"])).router, name) is None


@pytest.mark.parametrize("name", SETTINGS)
def test_the_config_file_sets_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(f"router: {{{name}: 750}}\n")
    assert getattr(load_config_file(path, ServeConfig).router, name) == 750.0
    path.write_text(f"router: {{{name}: 0}}\n")
    with pytest.raises(ConfigError, match=f"{name} must be positive"):
        load_config_file(path, ServeConfig)
