"""Where a measured table is cached, and the key that names it.

A measured table is cached (``cache_dir()``/<key>.json), keyed by
everything that changes step time (``deployment_key``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as _platform
from typing import Any

from vllm_specplug.deployment import model_runner

# Part of the cache key: a table measured by an older procedure is measured again.
PROFILE_FORMAT = 5


def cache_dir() -> str:
    """``$VLLM_SPECPLUG_PROFILE_CACHE``, or ``~/.cache/vllm-specplug/profiles``."""
    return os.environ.get("VLLM_SPECPLUG_PROFILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-specplug", "profiles")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def deployment_key(vllm_config, zero_cost: bool) -> dict[str, Any]:
    """Everything that changes how long a step takes."""
    import torch
    import vllm

    from vllm_specplug.version import __version__

    mc, spec = vllm_config.model_config, vllm_config.speculative_config
    par, cache = vllm_config.parallel_config, vllm_config.cache_config
    sched = vllm_config.scheduler_config
    draft = getattr(spec, "draft_model_config", None)
    try:
        from vllm.platforms import current_platform

        device = (cpu_model() if current_platform.is_cpu()
                  else str(current_platform.get_device_name()))
    except Exception:
        device = cpu_model()
    return {
        "target": str(mc.model), "draft": str(getattr(draft, "model", None)),
        "method": str(getattr(spec, "method", None)),
        "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0),
        "dtype": str(mc.dtype), "kv_cache_dtype": str(cache.cache_dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "tensor_parallel_size": int(par.tensor_parallel_size),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(mc.max_model_len), "block_size": int(cache.block_size),
        "enforce_eager": bool(mc.enforce_eager),
        "runner": model_runner(vllm_config),
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
        "compilation": _compilation(vllm_config),
        "zero_cost_fallback": bool(zero_cost),
        "threads": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")},
        "torch_threads": int(torch.get_num_threads()),
        "device": device, "cpus": os.cpu_count(),
        "torch": torch.__version__, "vllm": vllm.__version__, "plugin": __version__,
        "format": PROFILE_FORMAT,
    }


def _compilation(vllm_config) -> str:
    """Compilation mode and CUDA-graph mode, as vLLM resolved them."""
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "mode", None)
    graphs = getattr(comp, "cudagraph_mode", None)
    return f"mode={getattr(mode, 'name', mode)} cudagraph={getattr(graphs, 'name', graphs)}"


def cache_path(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{digest}.json")
