"""A Ray cluster of several nodes on this one machine, for the tests of this folder: Ray's own
`ray.cluster_utils.Cluster` starts a head and worker nodes, each a raylet with its own object
store, so actors on two nodes talk through Ray as on two machines (at the same IP).

A process joins one Ray cluster at a time: the session's single-node Ray (`ray_cluster`) is
shut down before each module of this folder and started again after it when it was running,
so the other system tests run alike before or after these."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from local_ray import start_local_ray
from multinode_support import NODE_STORE, RayNodes


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[RayNodes]:
    """A head node that runs no workers (num_cpus=0, as deployed) with this process connected
    to it; the tests add worker nodes. Torn down at the end of the module."""
    import ray
    from ray.cluster_utils import Cluster

    restore = ray.is_initialized()
    ray.shutdown()
    head = {"num_cpus": 0, "object_store_memory": NODE_STORE, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        nodes = RayNodes(cluster)
        yield nodes
        nodes.remove_all()
    finally:
        ray.shutdown()
        cluster.shutdown()
        if restore:
            start_local_ray()
