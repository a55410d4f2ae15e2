"""The single-node Ray cluster the system tests share, one per pytest session (the
`ray_cluster` fixture): started here so that a fixture that needs Ray to itself (a cluster of
several nodes, tests/system/multinode) can start it again as it was."""

from __future__ import annotations


def start_local_ray() -> None:
    """Start a local Ray of two CPUs and connect this process to it."""
    import ray

    ray.init(
        address="local",  # a cluster of its own, never one another process started
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 2**20,
    )
