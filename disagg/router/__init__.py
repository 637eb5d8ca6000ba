"""gRPC frontend, request orchestration, placement policy and latency model."""
