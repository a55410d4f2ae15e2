"""`cachesvc serve --placement` and the config file's `placement`: how the workers are laid
over the Ray cluster's nodes reaches the worker group, and a bad value names the choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config, serve_config_file
from cachesvc.app.config_file import load_config_file
from cachesvc.app.serve import ServeConfig
from cachesvc.kv.config import ConfigError


def test_spread_by_default_any_from_the_flag() -> None:
    assert serve_config(build_parser().parse_args(["serve"])).worker_group().placement == "spread"
    args = build_parser().parse_args(["serve", "--placement", "any"])
    assert serve_config(args).worker_group().placement == "any"


def test_placement_from_the_file_and_the_flag_over_it(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_workers: 4\nplacement: any\n")
    args = build_parser().parse_args(["serve", "--config", str(path)])
    group = serve_config_file(args.config, serve_config(args)).worker_group()
    assert (group.placement, group.num_workers) == ("any", 4)
    path.write_text("placement: any\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--placement", "spread"])
    # "spread" is the flag's default: a file's value stands unless the flag says otherwise.
    assert serve_config_file(args.config, serve_config(args)).placement == "any"


def test_a_bad_placement_in_the_file_names_the_key_and_the_choices(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("placement: strict_spread\n")
    with pytest.raises(ConfigError, match=r"placement must be one of \['spread', 'any'\]"):
        load_config_file(path, ServeConfig)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--placement", "pack"])
