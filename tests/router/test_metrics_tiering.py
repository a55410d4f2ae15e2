"""The workers' tier counters reach Prometheus: timed plans and their predicted and measured
seconds in families of their own, every other counter by name."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from router.metrics import _tiering_families
from workers.protocol import WorkerLoad


@dataclass
class _State:
    worker_id: str
    load: WorkerLoad = field(default_factory=WorkerLoad)


class _Collector:
    def __init__(self, states: list[_State]) -> None:
        self.states = states

    def collect(self) -> list[Metric]:
        return list(_tiering_families(self.states))


def test_plan_timing_and_tier_counters_are_exported() -> None:
    tiering = {
        "dram_hits": 12.0,
        "plan_split": 3.0,
        "plan_split_timed": 2.0,
        "plan_split_predicted_s": 0.5,
        "plan_split_actual_s": 0.55,
        "demoted": 7.0,
    }
    registry = CollectorRegistry()
    states = [_State("worker-0", WorkerLoad(tiering=tiering)), _State("worker-1")]
    registry.register(_Collector(states))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'cachesvc_worker_plans_timed_total{kind="split",worker="worker-0"} 2.0' in text
    for time_kind, value in (("predicted", "0.5"), ("actual", "0.55")):
        sample = f'{{kind="split",time="{time_kind}",worker="worker-0"}} {value}'
        assert f"cachesvc_worker_plan_seconds_total{sample}" in text
    for counter, value in (("dram_hits", "12.0"), ("plan_split", "3.0"), ("demoted", "7.0")):
        sample = f'{{counter="{counter}",worker="worker-0"}} {value}'
        assert f"cachesvc_worker_tiering_total{sample}" in text
    assert "worker-1" not in text  # a worker without tiers exports no samples
