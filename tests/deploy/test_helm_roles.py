"""The chart's prefill/decode worker groups: rendering with `rayCluster.roles` gives a KubeRay
worker group per role, sized by its own values, whose pods offer the Ray resource its workers
ask for, and a config that starts that many workers of each role; without roles nothing
changes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_render import Renderer, RenderError

from cachesvc.app.config_file import from_mapping
from cachesvc.app.serve import ServeConfig
from workers.cluster import role_resource, worker_resources

RAYCLUSTER_SCHEMA = json.loads((Path(__file__).parent / "raycluster.schema.json").read_text())
ROLES = [
    "rayCluster.roles.prefill.replicas=2",
    "rayCluster.roles.decode.replicas=1",
    # Decode pods of their own shape: two GPUs each (two decode workers) and more memory.
    "rayCluster.roles.decode.gpus=2",
    "rayCluster.roles.decode.baseMemoryMiB=32768",
]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _config(docs: list[dict[str, Any]]) -> ServeConfig:
    [cm] = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    return from_mapping(ServeConfig, yaml.safe_load(cm["data"]["config.yaml"]))


def _groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = _one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    return {g["groupName"]: g for g in specs}


def _ray_start(group: dict[str, Any]) -> list[str]:
    [container] = group["template"]["spec"]["containers"]
    words = shlex.split(" ".join(container["args"]))
    return words[words.index("ray") :]


def _offered(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources one pod of `group` offers Ray, from its `ray start` flags (and the
    same in rayStartParams, in KubeRay's form: JSON inside a quoted string, for the
    autoscaler)."""
    flags = [w for w in _ray_start(group) if w.startswith("--resources=")]
    if not flags:
        assert "resources" not in group["rayStartParams"]
        return {}
    [flag] = flags
    offered: dict[str, float] = json.loads(flag.removeprefix("--resources="))
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == offered
    return offered


def test_roles_give_a_worker_group_per_role_and_no_mixed_one(renderer: Renderer) -> None:
    docs = renderer.manifests(sets=ROLES)
    groups = _groups(docs)
    assert set(groups) == {"prefill", "decode"}
    prefill, decode = groups["prefill"], groups["decode"]
    # Fixed sizes: the router starts a set number of workers per role.
    assert (prefill["replicas"], prefill["minReplicas"], prefill["maxReplicas"]) == (2, 2, 2)
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (1, 1, 1)
    [p_container] = prefill["template"]["spec"]["containers"]
    [d_container] = decode["template"]["spec"]["containers"]
    assert p_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert d_container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert d_container["resources"]["limits"]["memory"] == f"{32768 + 4096}Mi"  # + DRAM tier
    assert "--num-gpus=2" in _ray_start(decode)
    for role, group in groups.items():
        assert group["template"]["metadata"]["labels"]["cachesvc.io/worker-role"] == role
        jsonschema.validate(_one(docs, "RayCluster"), RAYCLUSTER_SCHEMA)
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
        kubernetes_validate.validate({**template, "template": group["template"]}, "1.33", True)


def test_the_config_starts_each_roles_workers_where_its_pods_offer_room(
    renderer: Renderer,
) -> None:
    docs = renderer.manifests(sets=ROLES)
    config = _config(docs)
    # One worker per GPU of each role's pods: 2 pods x 1 GPU, 1 pod x 2 GPUs; no mixed.
    assert (config.num_prefill_workers, config.num_decode_workers, config.num_workers) == (2, 2, 0)
    group = config.worker_group()
    roles = [group.role_of(i) for i in range(group.num_workers)]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    # The Ray cluster these pods make: each role's workers ask for their role's resource, and
    # its pods together offer exactly one unit per worker of that role.
    groups = _groups(docs)
    cluster: dict[str, float] = {"CPU": 24.0, "GPU": 4.0}
    for spec in groups.values():
        for name, units in _offered(spec).items():
            cluster[name] = cluster.get(name, 0) + units * spec["replicas"]
    asks = worker_resources(group, cluster)
    for role in ("prefill", "decode"):
        assert asks.resources_of(role) == {role_resource(role): 1.0}
        assert cluster[role_resource(role)] == roles.count(role)


def test_mixed_workers_beside_roles_get_a_group_of_their_own(renderer: Renderer) -> None:
    docs = renderer.manifests(sets=[*ROLES, "rayCluster.worker.replicas=1"])
    groups = _groups(docs)
    assert set(groups) == {"gpu", "prefill", "decode"}
    # With roles, mixed pods are tagged too, so no other role's worker takes their GPU.
    assert _offered(groups["gpu"]) == {role_resource("mixed"): 1}
    assert _config(docs).num_mixed_workers == 1


def test_without_roles_nothing_changes(renderer: Renderer) -> None:
    docs = renderer.manifests()
    [group] = _groups(docs).values()
    assert group["replicas"] == 1 and group["groupName"] == "gpu"
    assert _offered(group) == {}
    assert "cachesvc.io/worker-role" not in group["template"]["metadata"]["labels"]
    [cm] = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    written = yaml.safe_load(cm["data"]["config.yaml"])
    assert "num_prefill_workers" not in written and "num_decode_workers" not in written
    config = _config(docs)
    assert (config.num_workers, config.num_prefill_workers, config.num_decode_workers) == (1, 0, 0)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["rayCluster.roles.prefill.replicas=1"], "roles.prefill has no workers to decode on"),
        (["rayCluster.roles.decode.replicas=1"], "roles.decode has no workers to compute"),
        (["rayCluster.roles.decode.gpu=1"], r"(?is)roles.decode.*\bgpu\b.*not allowed"),
    ],
)
def test_role_misconfigurations_fail_the_render(
    renderer: Renderer, sets: list[str], message: str
) -> None:
    with pytest.raises(RenderError, match=message):
        renderer.render(sets=sets)
