"""Deployment-test fixtures: the chart's renderer, and each values case rendered once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from chart_render import CASES, Rendered, Renderer, find_renderer


@pytest.fixture(scope="session")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return find_renderer(tmp_path_factory.mktemp("render"))


@pytest.fixture(scope="session")
def render_case(renderer: Renderer) -> Callable[[str], Rendered]:
    """Renders a named case of CASES once per session."""
    cache: dict[str, Rendered] = {}

    def render(case: str) -> Rendered:
        if case not in cache:
            cache[case] = Rendered(case, renderer.manifests(CASES[case]))
        return cache[case]

    return render
