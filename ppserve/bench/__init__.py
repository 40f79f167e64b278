"""Benchmarks: workloads of real-text prompts, a replay harness over the offline or gRPC API, policy
comparisons, capacity search, token-budget sweeps and simulator validation (ARCHITECTURE.md#serving-metrics).

`ppserve bench` (ppserve/bench/cli.py) and the scripts in benchmarks/ are thin fronts over this package.
Heavy packages (torch, ray, grpc, matplotlib) are imported only inside the functions that need them.
"""
