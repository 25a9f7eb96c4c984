"""Benchmark suite: `python -m vllm_specplug.bench` (see benchmarks/README.md)."""
