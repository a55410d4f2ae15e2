"""What the multi-node tests share: the cluster's nodes (`RayNodes`, made by the `ray_nodes`
fixture of conftest.py) and an actor's process, to freeze or kill it like a lost machine."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

NODE_STORE = 80 * 2**20  # object store per node: the tiny model's KV is a few MiB


class RayNodes:
    """A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`): add and
    remove worker nodes, pin actors to them."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.address: str = cluster.address

    def add(self, num_cpus: float = 1.0) -> Any:
        """Start a worker node (a raylet of its own) and wait until Ray lists it alive."""
        node = self.cluster.add_node(num_cpus=num_cpus, object_store_memory=NODE_STORE)
        self.cluster.wait_for_nodes()
        return node

    def remove(self, node: Any) -> None:
        """The node goes away at once, as a machine that loses power: its raylet and the
        processes it started are killed (SIGKILL), nothing is shut down cleanly."""
        if node in self.cluster.worker_nodes:
            self.cluster.remove_node(node, allow_graceful=False)

    def remove_all(self) -> None:
        for node in list(self.cluster.worker_nodes):
            self.remove(node)

    @staticmethod
    def pin(node: Any) -> Any:
        """A scheduling strategy that runs an actor on `node` and nowhere else."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node.node_id, soft=False)


def node_of(actor: Any, timeout_s: float = 120) -> str:
    """The id of the Ray node a worker actor runs on, as it reports it (`WorkerInfo`)."""
    import ray

    node_id: str = ray.get(actor.info.remote(), timeout=timeout_s).node_id
    return node_id


def pid_of(actor: Any) -> int:
    """The process id of an actor (every node runs on this machine)."""
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60))


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.kill(pid, sig)


FREEZE, KILL = signal.SIGSTOP, signal.SIGKILL
