"""Workers for the prefill/decode tests: each with its role, pulling from its peers."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from cachesvc.kv.config import TierConfig
from cachesvc.kv.types import WorkerId
from workers.config import EngineConfig


def spawn_pulling(
    engine_config: EngineConfig,
    roles: dict[WorkerId, str],
    overrides: dict[WorkerId, dict[str, Any]] | None = None,
) -> dict[WorkerId, Any]:
    """One worker actor per entry of `roles` (worker -> mixed | prefill | decode), half a CPU
    each, in a namespace of their own and named so a holder can be found, with pulls on and
    forced (the tiny model computes a prompt faster than a pull's prior cost, so the planner
    would recompute); `overrides`: engine settings of some workers. Kill them with
    `ray.kill`."""
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
            dataclasses.replace(base, role=role, **(overrides or {}).get(worker, {})),
            name=f"cachesvc-{worker}",
            namespace=namespace,
            num_cpus=0.5,
            max_restarts=0,
        )
        for worker, role in roles.items()
    }


def slow_steps(actor: Any, step_s: float) -> None:
    """Make every engine step of the worker take at least `step_s` longer (0: as fast as it
    is), as a long prompt's steps would on a real model: the tiny one steps in milliseconds."""
    import time

    import ray

    def arm(worker: Any) -> None:
        runner = worker._engine.engine.runner
        original = getattr(runner, "_unslowed", runner.execute)
        runner._unslowed = original

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(step_s)
            return original(*args, **kwargs)

        runner.execute = slow if step_s > 0 else original

    ray.get(actor.__ray_call__.remote(arm), timeout=60)
