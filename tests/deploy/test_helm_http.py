"""The chart exposes the OpenAI-compatible HTTP door: the config's http_port is the router's
`http` container port and a Service port; readiness may come from its /health."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart_render import Renderer, RenderError

from cachesvc.app.config_file import from_mapping
from cachesvc.app.serve import ServeConfig


def _router(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], ServeConfig]:
    [deploy] = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")
    ]
    [container] = [
        c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "router"
    ]
    [service] = [
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-cachesvc")
    ]
    [cm] = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    config = from_mapping(ServeConfig, yaml.safe_load(cm["data"]["config.yaml"]))
    return container, service, config


def test_http_port_is_a_container_and_service_port(renderer: Renderer) -> None:
    container, service, config = _router(renderer.manifests(sets=["router.service.httpPort=80"]))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.router.http_port is not None and ports["http"] == config.router.http_port
    [http] = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["targetPort"]) == (80, "http")
    assert "grpc" in container["readinessProbe"], "the gRPC probe unless asked otherwise"


def test_http_off_leaves_grpc_only(renderer: Renderer) -> None:
    container, service, config = _router(renderer.manifests(sets=["config.router.http_port=null"]))
    assert config.router.http_port is None
    assert "http" not in {p["name"] for p in container["ports"]}
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}


def test_readiness_from_http_health(renderer: Renderer) -> None:
    container, _, _ = _router(renderer.manifests(sets=["router.httpReadinessProbe=true"]))
    probe = container["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": "http", "scheme": "HTTP"}
    with pytest.raises(RenderError, match="needs config.router.http_port"):
        renderer.render(sets=["router.httpReadinessProbe=true", "config.router.http_port=null"])


def test_notes_show_a_curl_line(renderer: Renderer) -> None:
    notes = renderer.notes()
    assert "curl http://localhost:8000/v1/completions" in notes
