"""`cachesvc serve --prefill-workers N --decode-workers M` and the config file's
`num_prefill_workers` / `num_decode_workers`: how many workers of each role start, and errors
that name the flag when the counts make no deployment."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config, serve_config_file
from cachesvc.app.config_file import load_config_file
from cachesvc.app.serve import ServeConfig
from cachesvc.kv.config import ConfigError


def _roles(argv: list[str]) -> list[str]:
    group = serve_config(build_parser().parse_args(["serve", *argv])).worker_group()
    return [group.role_of(i) for i in range(group.num_workers)]


@pytest.mark.parametrize(
    ("argv", "roles"),
    [
        ([], ["mixed"]),  # as before roles: one mixed worker
        (["--workers", "3"], ["mixed"] * 3),
        # Either role flag: no mixed worker unless --workers asks for some.
        (["--prefill-workers", "1", "--decode-workers", "2"], ["prefill", "decode", "decode"]),
        (
            ["--prefill-workers", "1", "--decode-workers", "1", "--workers", "1"],
            ["prefill", "decode", "mixed"],
        ),
        (["--prefill-workers", "2", "--workers", "1"], ["prefill", "prefill", "mixed"]),
        (["--decode-workers", "1", "--workers", "2"], ["decode", "mixed", "mixed"]),
    ],
)
def test_role_flags_start_that_many_workers_of_each_role(argv: list[str], roles: list[str]) -> None:
    assert _roles(argv) == roles


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-workers", "-1", "--workers", "1"], "--prefill-workers must be >= 0, got -1"),
        (["--decode-workers", "-2", "--workers", "1"], "--decode-workers must be >= 0, got -2"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--prefill-workers", "2"], "--prefill-workers 2 leaves no worker to decode on"),
        (["--decode-workers", "1"], "--decode-workers 1 leaves no worker to compute prompts"),
        (
            ["--prefill-workers", "1", "--decode-workers", "1", "--workers", "-1"],
            "--workers must be >= 0",
        ),
    ],
)
def test_counts_that_make_no_deployment_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve_config(build_parser().parse_args(["serve", *argv])).worker_group()


def test_the_file_counts_roles_alike_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_prefill_workers: 2\nnum_decode_workers: 3\n")
    config = load_config_file(path, ServeConfig)
    group = config.worker_group()
    assert (group.num_workers, group.num_prefill, group.num_decode) == (5, 2, 3)
    # A flag given on the command line wins over the file; the file's other count stands.
    args = build_parser().parse_args(["serve", "--config", str(path), "--decode-workers", "1"])
    config = serve_config_file(args.config, serve_config(args))
    assert (config.num_prefill_workers, config.num_decode_workers, config.num_mixed_workers) == (
        2,
        1,
        0,
    )
    # The file's mixed workers stand beside the role flags.
    path.write_text("num_workers: 2\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--prefill-workers", "1"])
    config = serve_config_file(args.config, serve_config(args))
    assert [config.worker_group().role_of(i) for i in range(3)] == ["prefill", "mixed", "mixed"]


def test_roles_need_the_routers_peer_pulls(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_prefill_workers: 1\nnum_decode_workers: 1\nrouter: {peer_pull: false}\n")
    with pytest.raises(ConfigError, match="router.peer_pull must be true"):
        load_config_file(path, ServeConfig)
    # Without roles the router may do without pulls, as before.
    path.write_text("num_workers: 2\nrouter: {peer_pull: false}\n")
    assert load_config_file(path, ServeConfig).worker_group().num_workers == 2


def test_a_bad_count_in_the_file_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_prefill_workers: two\n")
    with pytest.raises(ConfigError, match="num_prefill_workers must be an integer"):
        load_config_file(path, ServeConfig)


def test_pd_mode_flag_reaches_the_router() -> None:
    args = ["serve", "--prefill-workers", "1", "--decode-workers", "1", "--pd-mode", "always"]
    assert serve_config(build_parser().parse_args(args)).router.pd_mode == "always"
    assert serve_config(build_parser().parse_args(["serve"])).router.pd_mode == "auto"
    slo = serve_config(build_parser().parse_args(["serve", "--pd-itl-slo-ms", "250"])).router
    assert (slo.pd_itl_slo_ms, slo.pd_ttft_slo_ms) == (250.0, None)


def test_prefill_chunk_tokens_sets_the_prefill_workers_step_only() -> None:
    args = ["serve", "--prefill-workers", "1", "--decode-workers", "1"]
    config = serve_config(build_parser().parse_args([*args, "--prefill-chunk-tokens", "512"]))
    group = config.worker_group()
    engines = [group.engine_of(i, config.engine) for i in range(2)]
    budgets = [e.max_num_batched_tokens for e in engines]
    assert budgets == [512, config.engine.max_num_batched_tokens]
    # Unset, every worker steps the engine's budget.
    plain = serve_config(build_parser().parse_args(args))
    group = plain.worker_group()
    assert group.engine_of(0, plain.engine).max_num_batched_tokens == 2048


def test_a_bad_prefill_chunk_names_it(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("num_prefill_workers: 1\nnum_decode_workers: 1\nprefill_chunk_tokens: 0\n")
    config = load_config_file(str(path), ServeConfig)
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        config.worker_group()
