"""How a worker group asks Ray for its workers (pure: no Ray here) and how their placement is
reported to the operator."""

from __future__ import annotations

import pytest

from cachesvc.kv.config import ConfigError
from cachesvc.kv.types import WorkerId
from workers.cluster import WorkerGroup, placement_report, worker_resources
from workers.config import EngineConfig
from workers.protocol import WorkerInfo

ENGINE = EngineConfig(model="tiny", device="cpu")


@pytest.mark.parametrize(
    ("device", "placement", "num_workers", "cluster", "expected"),
    [
        # A GPU anywhere in the cluster: "auto" takes one per worker (Ray then only considers
        # the GPU nodes), even when CPU-only nodes are many.
        ("auto", "spread", 2, {"CPU": 16.0, "GPU": 2.0}, ("cuda", 1.0, 1.0, "SPREAD")),
        ("auto", "spread", 4, {"CPU": 64.0, "GPU": 1.0}, ("cuda", 1.0, 1.0, "SPREAD")),
        ("auto", "any", 2, {"CPU": 16.0}, ("cpu", 0.0, 1.0, "DEFAULT")),
        ("cpu", "spread", 2, {"CPU": 16.0, "GPU": 8.0}, ("cpu", 0.0, 1.0, "SPREAD")),
        ("cuda", "spread", 1, {"CPU": 4.0}, ("cuda", 1.0, 1.0, "SPREAD")),
        # Fewer CPUs than workers in the whole cluster: they share them.
        ("cpu", "spread", 4, {"CPU": 2.0}, ("cpu", 0.0, 0.5, "SPREAD")),
    ],
)
def test_worker_resources(
    device: str,
    placement: str,
    num_workers: int,
    cluster: dict[str, float],
    expected: tuple[str, float, float, str],
) -> None:
    group = WorkerGroup(ENGINE, num_workers, device=device, placement=placement)  # type: ignore[arg-type]
    asks = worker_resources(group, cluster)
    assert (asks.engine.device, asks.num_gpus, asks.num_cpus, asks.scheduling_strategy) == expected


def test_spread_is_the_default_and_a_bad_placement_says_the_choices() -> None:
    assert WorkerGroup(ENGINE).placement == "spread"
    with pytest.raises(ConfigError, match="spread, any.*'packed'"):
        WorkerGroup(ENGINE, placement="packed")  # type: ignore[arg-type]


def _info(worker: str, node: str | None) -> WorkerInfo:
    return WorkerInfo(worker, "inc", "fp", 4, 320, 512, "cpu", node_id=node, node_ip="10.0.0.7")


def test_placement_report_names_each_workers_node_and_counts_the_nodes() -> None:
    infos = {
        WorkerId("worker-1"): _info("worker-1", "bbbbbbbbbbbbbbbbffff"),
        WorkerId("worker-0"): _info("worker-0", "aaaaaaaaaaaaaaaaffff"),
        WorkerId("worker-2"): _info("worker-2", "aaaaaaaaaaaaaaaaffff"),
        WorkerId("worker-3"): None,  # did not answer
    }
    assert placement_report(infos) == [
        "worker-0 runs on node aaaaaaaaaaaa at 10.0.0.7 (cpu)",
        "worker-1 runs on node bbbbbbbbbbbb at 10.0.0.7 (cpu)",
        "worker-2 runs on node aaaaaaaaaaaa at 10.0.0.7 (cpu)",
        "worker-3 runs on node unknown",
        "3 workers on 2 Ray nodes (2 + 1)",
    ]
