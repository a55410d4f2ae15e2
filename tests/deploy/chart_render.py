"""The Helm chart rendered by a real Go-template engine, for the deployment tests.

`helm template` when helm is installed; otherwise deploy/tools/render, a small Go program over
text/template + sprig with Helm's own functions, built once per session from Debian's packaged
sources (golang-go, golang-github-masterminds-sprig-dev, golang-gopkg-yaml.v2-dev,
golang-github-xeipuuv-gojsonschema-dev: .ci/run installs them). Without either the chart tests
skip, saying so; under CI (CI set) they fail instead, so a broken install cannot hide them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from suite_support import unavailable

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "cachesvc"
RENDER_SRC = REPO / "deploy" / "tools" / "render"
GOPATH = Path("/usr/share/gocode")
GO_PACKAGES = (
    "github.com/Masterminds/sprig",
    "gopkg.in/yaml.v2",
    "github.com/xeipuuv/gojsonschema",
)
# Debian packages holding GO_PACKAGES' sources.
DEBS = (
    "golang-github-masterminds-sprig-dev golang-gopkg-yaml.v2-dev "
    "golang-github-xeipuuv-gojsonschema-dev"
)
RELEASE = "demo"
NAMESPACE = "llm"


class RenderError(Exception):
    """The chart refused to render; the message is the renderer's stderr."""


@dataclass(frozen=True)
class Renderer:
    """Renders the chart like `helm template demo CHART -n llm -f ... --set ...`."""

    command: tuple[str, ...]  # the renderer binary, or helm
    is_helm: bool

    def render(self, values: Sequence[Path] = (), sets: Sequence[str] = ()) -> str:
        args = (
            ["template", RELEASE, str(CHART)] if self.is_helm else [str(CHART), "--name", RELEASE]
        )
        return self._run([*args, *self._value_args(values, sets)])

    def notes(self, values: Sequence[Path] = (), sets: Sequence[str] = ()) -> str:
        if not self.is_helm:
            return self._run(
                [str(CHART), "--name", RELEASE, "--notes", *self._value_args(values, sets)]
            )
        out = self._run(
            ["install", RELEASE, str(CHART), "--dry-run=client", *self._value_args(values, sets)]
        )
        return out.split("NOTES:", 1)[1]

    def manifests(
        self, values: Sequence[Path] = (), sets: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(self.render(values, sets)) if doc]

    @staticmethod
    def _value_args(values: Sequence[Path], sets: Sequence[str]) -> list[str]:
        args = ["--namespace", NAMESPACE]
        for path in values:
            args += ["-f", str(path)]
        for expr in sets:
            args += ["--set", expr]
        return args

    def _run(self, args: list[str]) -> str:
        proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip())
        return proc.stdout


def build_render_tool(out_dir: Path) -> Path:
    go = shutil.which("go")
    if go is None:
        unavailable(f"neither helm nor go is installed: apt-get install golang-go {DEBS}")
    missing = [pkg for pkg in GO_PACKAGES if not (GOPATH / "src" / pkg).is_dir()]
    if missing:
        unavailable(f"Go sources missing under {GOPATH}: {missing}; apt-get install {DEBS}")
    binary = out_dir / "render"
    # GOPATH mode over Debian's packaged sources: no module download, works offline.
    env = {
        **os.environ,
        "GOPATH": str(GOPATH),
        "GO111MODULE": "off",
        "GOFLAGS": "",
        "GOCACHE": os.environ.get("GOCACHE", str(out_dir / "gocache")),
    }
    proc = subprocess.run(
        [str(go), "build", "-o", str(binary), "."],
        cwd=RENDER_SRC,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"building deploy/tools/render failed:\n{proc.stderr}"
    return binary


# The values files the chart is rendered with: the defaults, and the files under ci/.
CASES = {
    "default": (),
    "gpu-redis-tls": (CHART / "ci" / "gpu-redis-tls-values.yaml",),
    "cpu": (CHART / "ci" / "cpu-values.yaml",),
}


@dataclass(frozen=True)
class Rendered:
    """One rendering of the chart, its manifests grouped by kind."""

    case: str
    docs: list[dict[str, Any]]

    def kinds(self) -> set[str]:
        return {doc["kind"] for doc in self.docs}

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [
            d
            for d in self.docs
            if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)
        ]
        assert len(found) == 1, f"{self.case}: {len(found)} {kind} named *{name_suffix}"
        return found[0]


def find_renderer(tmp_dir: Path) -> Renderer:
    """helm if installed, else deploy/tools/render built into `tmp_dir`."""
    helm = shutil.which("helm")
    if helm is not None:
        return Renderer((helm,), is_helm=True)
    return Renderer((str(build_render_tool(tmp_dir)),), is_helm=False)
