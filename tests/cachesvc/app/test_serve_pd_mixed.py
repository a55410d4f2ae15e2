"""`cachesvc serve --pd-mixed`: hand-offs between mixed workers reach the router's config, are
off without the flag, and turn on the workers' pulls (a hand-off is a pull between them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config
from cachesvc.app.config_file import load_config_file
from cachesvc.app.serve import ServeConfig
from cachesvc.kv.config import ConfigError


def test_pd_mixed_flag_reaches_the_router() -> None:
    args = build_parser().parse_args(["serve", "--workers", "2", "--pd-mixed"])
    assert serve_config(args).router.pd_mixed
    assert not serve_config(build_parser().parse_args(["serve", "--workers", "2"])).router.pd_mixed


def test_pd_mixed_turns_on_the_workers_pulls() -> None:
    """Without pulls a mixed worker reports no pull cost, and the router keeps every request
    colocated: the flag would do nothing."""
    with_flag = serve_config(build_parser().parse_args(["serve", "--workers", "2", "--pd-mixed"]))
    group = with_flag.worker_group()
    assert all(group.engine_of(i, group.engine).peer_pull for i in range(2))
    without = serve_config(build_parser().parse_args(["serve", "--workers", "2"])).worker_group()
    assert not any(without.engine_of(i, without.engine).peer_pull for i in range(2))


def test_pd_mixed_needs_the_routers_peer_pulls(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_workers: 2\nrouter: {pd_mixed: true, peer_pull: false}\n")
    with pytest.raises(ConfigError, match="router.peer_pull must be true with --pd-mixed"):
        load_config_file(path, ServeConfig)
