"""Benchmark suite: `python -m vllm_specplug.tools.bench` (see benchmarks/README.md)."""
