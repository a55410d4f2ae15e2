"""The OpenAI-compatible HTTP door: `/v1/completions`, `/v1/chat/completions`, `/v1/models`
and `/health` beside the gRPC door, on the router's event loop.

Like `router/grpc/server.py` for gRPC, it only translates (JSON body -> `GenerateInput`, deltas ->
OpenAI JSON or server-sent events, router errors -> OpenAI error bodies with HTTP statuses);
auth, tenants, limits, the response cache, routing and failover are the router core's.
"""
