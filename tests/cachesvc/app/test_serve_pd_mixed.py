"""`cachesvc serve --pd-mixed`: hand-offs between mixed workers reach the router's config, and
are off without the flag."""

from __future__ import annotations

from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config


def test_pd_mixed_flag_reaches_the_router() -> None:
    args = build_parser().parse_args(["serve", "--workers", "2", "--pd-mixed"])
    assert serve_config(args).router.pd_mixed
    assert not serve_config(build_parser().parse_args(["serve", "--workers", "2"])).router.pd_mixed
