"""Benchmarks: store throughput, TTFT, trace replay, capacity planning, soak."""
