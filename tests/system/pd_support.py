"""Workers for the prefill/decode tests: each with its role, pulling from its peers."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from cachesvc.config import EngineConfig, TierConfig
from cachesvc.types import WorkerId


def spawn_pulling(engine_config: EngineConfig, roles: dict[WorkerId, str]) -> dict[WorkerId, Any]:
    """One worker actor per entry of `roles` (worker -> mixed | prefill | decode), half a CPU
    each, in a namespace of their own and named so a holder can be found, with pulls on and
    forced (the tiny model computes a prompt faster than a pull's prior cost, so the planner
    would recompute). Kill them with `ray.kill`."""
    from workers.spawn import spawn_worker

    base = dataclasses.replace(
        engine_config,
        peer_pull=True,
        peer_pull_timeout_s=3.0,
        tiers=TierConfig(plan="fetch", calibrate=False),
    )
    namespace = f"pd-test-{uuid.uuid4().hex[:6]}"
    return {
        worker: spawn_worker(
            worker,
            dataclasses.replace(base, role=role),
            name=f"cachesvc-{worker}",
            namespace=namespace,
            num_cpus=0.5,
            max_restarts=0,
        )
        for worker, role in roles.items()
    }
