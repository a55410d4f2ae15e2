"""The Helm chart, rendered for real: Kubernetes-valid manifests, a config cachesvc loads, and
every cross-reference (ports, names, secrets, volumes, resources) lining up."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_render import CASES, CHART, NAMESPACE, RELEASE, Rendered, Renderer, RenderError

from cachesvc.app.config_file import from_mapping
from cachesvc.app.serve import ServeConfig
from cachesvc.kv.config import ConfigError

# The chart's kubeVersion floor and a recent release: schemas of both must accept every manifest.
KUBE_VERSIONS = ("1.27", "1.33")
RAYCLUSTER_SCHEMA = json.loads((Path(__file__).parent / "raycluster.schema.json").read_text())
FULLNAME = f"{RELEASE}-cachesvc"


def _serve_config(r: Rendered) -> ServeConfig:
    text = r.one("ConfigMap", "-config")["data"]["config.yaml"]
    return from_mapping(ServeConfig, yaml.safe_load(text))


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    [container] = [c for c in pod_spec["containers"] if c["name"] == name]
    return container


def _worker_group(r: Rendered) -> dict[str, Any]:
    [group] = r.one("RayCluster")["spec"]["workerGroupSpecs"]
    return group


def _validate_k8s(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_is_valid_kubernetes(render_case: Any, case: str) -> None:
    r = render_case(case)
    for doc in r.docs:
        if doc["kind"] == "RayCluster":
            jsonschema.validate(doc, RAYCLUSTER_SCHEMA)
            spec = doc["spec"]
            templates = [spec["headGroupSpec"]["template"]]
            templates += [g["template"] for g in spec["workerGroupSpecs"]]
            for template in templates:  # the pods KubeRay will create, as core/v1 PodTemplates
                pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
                for version in KUBE_VERSIONS:
                    _validate_k8s({**pod, "template": template}, version)
            continue
        for version in KUBE_VERSIONS:
            _validate_k8s(doc, version)


@pytest.mark.parametrize(
    ("case", "kinds"),
    [
        ("default", {"ConfigMap", "Secret", "Service", "Deployment", "RayCluster"}),
        (
            "gpu-redis-tls",
            {"ConfigMap", "Secret", "Service", "Deployment", "RayCluster", "StatefulSet"}
            | {"HorizontalPodAutoscaler", "PodDisruptionBudget", "Ingress"},
        ),
        ("cpu", {"ConfigMap", "Secret", "Service", "Deployment", "RayCluster"}),
    ],
)
def test_objects_per_values_file(render_case: Any, case: str, kinds: set[str]) -> None:
    assert render_case(case).kinds() == kinds


@pytest.mark.parametrize("case", CASES)
def test_config_map_loads_into_serve_config(render_case: Any, case: str) -> None:
    r = render_case(case)
    config = _serve_config(r)
    group = _worker_group(r)
    gpus = int(group["rayStartParams"]["num-gpus"])
    assert config.num_workers == group["replicas"] * max(gpus, 1)
    assert config.ray_address == f"ray://{FULLNAME}-ray-head-svc.{NAMESPACE}.svc:10001"
    assert config.router.host == "0.0.0.0"
    assert config.router.auth_token is None  # the token comes from the Secret, never the map


@pytest.mark.parametrize("case", CASES)
def test_router_ports_probes_and_secrets_line_up(render_case: Any, case: str) -> None:
    r = render_case(case)
    config = _serve_config(r)
    deployment = r.one("Deployment", "-router")
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    router = _container(pod, "router")
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["grpc"] == config.router.port
    assert ports.get("metrics") == config.router.metrics_port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert router[probe]["grpc"]["port"] == config.router.port, probe
    # Liveness asks the always-SERVING Admin service: no workers must not restart the router.
    assert router["livenessProbe"]["grpc"]["service"] == "cachesvc.v1.Admin"
    assert "service" not in router["readinessProbe"]["grpc"]

    service = r.one("Service", FULLNAME)
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert service["spec"]["selector"].items() <= labels.items()

    args = router["args"]
    assert args[:3] == ["serve", "--config", "/etc/cachesvc/config/config.yaml"]
    token_file = args[args.index("--auth-token-file") + 1]
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    assert token_file == f"{mounts['auth']}/token"
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = r.one("Secret", "-auth")
    assert volumes["auth"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert "token" in secret["data"]
    assert volumes["config"]["configMap"]["name"] == r.one("ConfigMap")["metadata"]["name"]


@pytest.mark.parametrize("case", CASES)
def test_workers_join_the_head_with_their_gpus_and_tiers(render_case: Any, case: str) -> None:
    r = render_case(case)
    config = _serve_config(r)
    group = _worker_group(r)
    gpus = int(group["rayStartParams"]["num-gpus"])
    pod = group["template"]["spec"]
    worker = _container(pod, "ray-worker")

    words = shlex.split(" ".join(worker["args"]))
    start = words[words.index("ray") :]
    assert start[:2] == ["ray", "start"]
    assert f"--address={FULLNAME}-ray-head-svc.{NAMESPACE}.svc:6379" in start
    assert f"--num-gpus={gpus}" in start and "--block" in start
    limits = worker["resources"]["limits"]
    assert worker["resources"]["requests"] == limits
    assert int(limits.get("nvidia.com/gpu", 0)) == gpus
    assert worker["image"].endswith("-cuda" if gpus else "-cpu")

    # The DRAM tier is part of the pod's memory; the NVMe volume is mounted where the tier writes.
    tiers = config.engine.tiers
    base = yaml.safe_load((CHART / "values.yaml").read_text())["rayCluster"]["worker"]
    for path in CASES[case]:
        base |= (yaml.safe_load(path.read_text()).get("rayCluster") or {}).get("worker", {})
    assert limits["memory"] == f"{base['baseMemoryMiB'] + int(tiers.dram_mb)}Mi"
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["nvme"] == tiers.nvme_path
    [nvme] = [v for v in pod["volumes"] if v["name"] == "nvme"]
    if "ephemeral" in nvme:
        size = nvme["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"]
        assert int(size.removesuffix("Mi")) >= tiers.nvme_mb
    else:
        [init] = pod["initContainers"]
        assert init["command"][-1] == tiers.nvme_path  # hands the node folder to uid 10001

    head = r.one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    head_args = " ".join(_container(head, "ray-head")["args"])
    assert "--head" in head_args and "--num-cpus=0" in head_args
    assert "--ray-client-server-port=10001" in head_args


def test_redis_and_tls_are_wired(render_case: Any) -> None:
    r = render_case("gpu-redis-tls")
    config = _serve_config(r)
    redis = r.one("StatefulSet", "-redis")
    service = r.one("Service", "-redis")
    assert config.engine.tiers.redis_url == (
        f"redis://{service['metadata']['name']}.{NAMESPACE}.svc:6379/0"
    )
    secret = r.one("Secret", "-redis")
    router = _container(r.one("Deployment")["spec"]["template"]["spec"], "router")
    [env] = [e for e in router["env"] if e["name"] == "CACHESVC_REDIS_PASSWORD"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    redis_env = _container(redis["spec"]["template"]["spec"], "redis")["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in redis_env} == {ref["name"]}

    ingress = r.one("Ingress")
    assert ingress["spec"]["tls"][0]["hosts"] == ["llm.example.com"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == (
        "GRPC"
    )
    hpa = r.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == r.one("Deployment")["metadata"]["name"]
    assert "replicas" not in r.one("Deployment")["spec"]  # the HPA owns it


def test_external_redis_over_tls_mounts_its_ca(render_case: Any) -> None:
    r = render_case("cpu")
    tiers = _serve_config(r).engine.tiers
    assert tiers.redis_url == "rediss://redis.shared.svc:6380/0"
    for pod in (
        r.one("Deployment")["spec"]["template"]["spec"],
        _worker_group(r)["template"]["spec"],
    ):
        container = pod["containers"][0]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "redis-ca"]
        assert tiers.redis_tls_ca_file == f"{mount['mountPath']}/ca.crt"
        [volume] = [v for v in pod["volumes"] if v["name"] == "redis-ca"]
        assert volume["secret"]["secretName"] == "shared-redis-ca"


def test_the_tier_key_secret_is_mounted_in_the_workers_only(render_case: Any) -> None:
    r = render_case("gpu-redis-tls")
    key_file = _serve_config(r).engine.tiers.tier_key_file
    pod = _worker_group(r)["template"]["spec"]
    [mount] = [m for m in _container(pod, "ray-worker")["volumeMounts"] if m["name"] == "tier-key"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "tier-key"]
    assert mount["readOnly"] and volume["secret"]["secretName"] == "cachesvc-tier-key"
    [item] = volume["secret"]["items"]
    assert item["key"] == "key" and key_file == f"{mount['mountPath']}/{item['path']}"
    router = r.one("Deployment")["spec"]["template"]["spec"]
    assert "tier-key" not in {v["name"] for v in router["volumes"]}  # the router signs nothing
    # Without the Secret, blocks are checksummed: no key file, nothing mounted.
    plain = render_case("default")
    assert _serve_config(plain).engine.tiers.tier_key_file is None
    worker = _container(_worker_group(plain)["template"]["spec"], "ray-worker")
    assert "tier-key" not in {m["name"] for m in worker["volumeMounts"]}


def test_an_unknown_config_key_fails_the_load_naming_it(renderer: Renderer) -> None:
    docs = renderer.manifests(sets=["config.engine.tiers.dram_gb=4"])
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    with pytest.raises(ConfigError, match=r"unknown key 'engine\.tiers\.dram_gb'.*'dram_mb'"):
        from_mapping(ServeConfig, yaml.safe_load(cm["data"]["config.yaml"]))


def test_an_unknown_chart_value_fails_the_render(renderer: Renderer) -> None:
    with pytest.raises(RenderError, match=r"(?is)raycluster.worker.*\bgpu\b.*not allowed"):
        renderer.render(sets=["rayCluster.worker.gpu=2"])


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["config.router.auth_token=x"], "set auth.token"),
        (["config.engine.tiers.redis_password=x"], "set redis.auth.password"),
        (["rayCluster.enabled=false"], "set config.ray_address"),
        (["router.tls.enabled=true"], "needs router.tls.secretName"),
        (["router.tls.clientCaSecretName=ca"], "needs router.tls.enabled"),
        (
            ["tierKey.secretName=k", "config.engine.tiers.tier_key_file=/k"],
            "set only tierKey.secretName",
        ),
    ],
)
def test_misconfigurations_fail_the_render(
    renderer: Renderer, sets: list[str], message: str
) -> None:
    with pytest.raises(RenderError, match=message):
        renderer.render(sets=sets)


def test_auth_off_has_no_secret_and_no_token_flag(renderer: Renderer) -> None:
    docs = renderer.manifests(sets=["auth.enabled=false"])
    assert not [d for d in docs if d["kind"] == "Secret"]
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    assert "--auth-token-file" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_notes_tell_how_to_call_it(renderer: Renderer) -> None:
    notes = renderer.notes()
    assert f"port-forward svc/{FULLNAME} 50051:50051" in notes
    assert f"get secret {FULLNAME}-auth" in notes
    assert 'grpcurl -plaintext -H "authorization: Bearer $TOKEN" $CACHESVC list' in notes
    assert "cachesvc.v1.Inference/Generate" in notes
    tls = renderer.notes(sets=["ingress.enabled=true", "ingress.tls.enabled=true"])
    assert "export CACHESVC=cachesvc.example.com:443" in tls
    assert "grpcurl -H" in tls and "-plaintext" not in tls


def test_values_schema_accepts_the_shipped_values_files() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(defaults, schema)
    for path in (CHART / "ci").glob("*-values.yaml"):
        jsonschema.validate(_merge(defaults, yaml.safe_load(path.read_text())), schema)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def test_every_value_is_documented() -> None:
    """Each key of values.yaml has a comment right above it, follows a documented sibling (one
    comment may cover a run of keys), or sits inside a documented block (requests/limits)."""
    undocumented = []
    parents: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    last_sibling: dict[int, bool] = {}
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        key, sep, value = line.strip().partition(":")
        if not sep or not key or key.startswith(("#", "-")):
            continue
        indent = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= indent:
            parents.pop()
        above = lines[i - 1].strip()
        documented = (
            above.startswith("#")
            or (above != "" and last_sibling.get(indent, False))
            or (bool(parents) and parents[-1][1])
        )
        last_sibling = {k: v for k, v in last_sibling.items() if k <= indent}
        last_sibling[indent] = documented
        parents.append((indent, documented))
        if value.strip() and not documented:
            undocumented.append(key)
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_router_tls_and_tenant_tokens_mount_their_secrets_and_probe_in_plaintext(
    renderer: Renderer,
) -> None:
    from cachesvc.app.cli.main import build_parser

    sets = [
        "router.tls.enabled=true",
        "router.tls.secretName=router-tls",
        "router.tls.clientCaSecretName=clients-ca",
        "router.tls.healthPort=9191",
        "auth.tenantTokensSecret=tenant-tokens",
        "ingress.enabled=true",
    ]
    docs = renderer.manifests(sets=sets)
    for doc in docs:
        if doc["kind"] != "RayCluster":
            _validate_k8s(doc, KUBE_VERSIONS[-1])
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    router = _container(pod, "router")
    args = router["args"]
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}

    def mounted(flag: str, volume: str, key: str, secret: str) -> None:
        assert args[args.index(flag) + 1] == f"{mounts[volume]}/{key}", flag
        assert volumes[volume]["secretName"] == secret
        assert {i["key"] for i in volumes[volume]["items"]} >= {key}

    mounted("--tls-cert-file", "tls", "tls.crt", "router-tls")
    mounted("--tls-key-file", "tls", "tls.key", "router-tls")
    mounted("--tls-client-ca-file", "client-ca", "ca.crt", "clients-ca")
    mounted("--tenant-tokens-file", "tenants", "tokens", "tenant-tokens")
    # The flags are ones `cachesvc serve` takes, and the health port reaches the router.
    parsed = build_parser().parse_args(args[:3] + args[args.index("--tls-cert-file") :])
    assert parsed.health_port == 9191
    assert _router_options_without_files(parsed)["health_port"] == 9191
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = router[probe]["exec"]["command"]
        assert command[:3] == ["python", "/opt/cachesvc/healthcheck.py", "127.0.0.1:9191"]
    assert router["livenessProbe"]["exec"]["command"][3:] == ["cachesvc.v1.Admin"]
    assert router["readinessProbe"]["exec"]["command"][3:] == []
    [ingress] = [d for d in docs if d["kind"] == "Ingress"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == (
        "GRPCS"
    )
    notes = renderer.notes(sets=[*sets[:3], "ingress.enabled=false"])
    assert "-cacert" in notes and "-plaintext" not in notes


def _router_options_without_files(parsed: Any) -> dict[str, Any]:
    """`_router_options` of parsed flags, without reading the tenant tokens file they name."""
    from cachesvc.app.cli.serve import _router_options

    parsed.tenant_tokens_file = None
    return _router_options(parsed)
