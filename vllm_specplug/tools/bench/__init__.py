"""Benchmark suite: `python -m vllm_specplug.tools.bench` (see benchmarks/README.md)."""

import os
import sys


def exit_quietly(code: int | None) -> None:
    """Leave with ``code`` without the interpreter's module teardown.

    When a benchmark's main returns, every server has stopped and every
    file is written; what the teardown adds is Triton's nanobind reporting
    objects it never freed ("nanobind: leaked ..."), a page of lines after
    the table.  So a benchmark's last screen is its result."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
