"""Container health check: exit 0 when the cachesvc router's gRPC health service says SERVING.

Usage: python healthcheck.py [HOST:PORT] [SERVICE]  (defaults 127.0.0.1:50051 and "", the
router's overall status: SERVING while at least one worker is healthy). Health checks need no
bearer token. Docker's HEALTHCHECK runs it; Kubernetes uses its own gRPC probes instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: Sequence[str]) -> int:
    address = argv[0] if argv else "127.0.0.1:50051"
    service = argv[1] if len(argv) > 1 else ""
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=3)
        except grpc.RpcError as exc:
            print(f"unhealthy: {address}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {address} {service or '(overall)'} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
