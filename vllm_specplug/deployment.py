"""What a deployment's vLLM config means for the plugin, asked alike by the scheduler and workers.

The scheduler prices steps by whether the draft model skips K_step = 0 steps
(zero-cost fallback); the workers' patch (``patches/draft_model_skip.py``)
does the skipping.  Both ask ``zero_cost_fallback_for`` here, so they cannot
disagree on anything the config decides.  What only a worker can see (its
model runner, the draft's attention groups) it checks itself, and says
loudly when it cannot honour what the config promised; each step's output
tells the scheduler what the worker actually does (``ZERO_COST_OUTPUT_ATTR``).

Config only: this module imports neither the scheduler nor the controller,
so a worker asks without loading them.
"""

from __future__ import annotations

# Proposers that honour a K_step below num_speculative_tokens.  The others
# (suffix, ngram_gpu, medusa, ...) assert K_step == num_speculative_tokens:
# for them K_step stays pinned and only per-request trimming adapts.
ADAPTIVE_K_STEP_METHODS = frozenset({"ngram", "draft_model", "eagle", "eagle3"})
DRAFT_MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "mtp", "medusa"})

_PACKAGE = "vllm_specplug."

# The attribute of vLLM's ModelRunnerOutput by which a worker reports each
# step whether it skips the draft at K_step = 0 (set by the patch, read by
# the scheduler: the workers' actual state, not the config's promise).
ZERO_COST_OUTPUT_ATTR = "specplug_zero_cost"


def catch_up_tokens(stale_from: int, computed: int, block_size: int) -> int:
    """Tokens the zero-cost catch-up runs the draft over for one request.

    The worker marks whole KV blocks stale and repairs from the start of the
    first one (``patches/draft_model_skip.py``): a request whose draft
    skipped from position ``stale_from`` on, with ``computed`` tokens before
    the step, is caught up from its block's start, not from the skipped
    token.  The scheduler prices catch-ups, and the start-up profile times
    them, in these tokens.
    """
    return max(int(computed) - (int(stale_from) // max(int(block_size), 1)) * int(block_size), 0)


def uses_plugin_scheduler(vllm_config) -> bool:
    """Whether this engine's scheduler is vllm_specplug's (or a subclass of it)."""
    sched = getattr(vllm_config, "scheduler_config", None)
    cls = getattr(sched, "scheduler_cls", None)
    if isinstance(cls, str) and cls.startswith(_PACKAGE):
        return True
    if not isinstance(cls, type):
        try:  # a user's subclass named by its own path
            cls = sched.get_scheduler_cls()
        except Exception:
            return False
    return isinstance(cls, type) and any(
        (c.__module__ or "").startswith(_PACKAGE) for c in cls.__mro__)


def k_step_pinned_for(vllm_config) -> bool:
    """Whether K_step must stay at num_speculative_tokens.

    Proposers that need a fixed K, and data-parallel ranks, which may step in
    lockstep (MoE), where a different number of draft passes per rank would
    hang their collectives.
    """
    method = getattr(vllm_config.speculative_config, "method", None)
    dp = getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1
    return method not in ADAPTIVE_K_STEP_METHODS or dp > 1


def model_runner(vllm_config) -> str:
    """The workers' model runner: ``"cpu-v1"``, ``"gpu-v1"``, ``"gpu-v2"`` or ``"other"``.

    vLLM picks it from the config alone (``VllmConfig.use_v2_model_runner``,
    read by the workers of the CPU and CUDA platforms), so the scheduler's
    process knows it at start-up.
    """
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            device = "cpu"
        elif current_platform.is_cuda_alike():
            device = "gpu"
        else:
            return "other"
    except Exception:
        return "other"
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception:
        return "other"
    return f"{device}-{'v2' if v2 else 'v1'}"


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:
        return False


def _vocab(model_config) -> int | None:
    try:
        return int(model_config.get_vocab_size())
    except Exception:
        return None


def zero_cost_fallback_for(vllm_config, enabled: bool) -> tuple[bool, str]:
    """(whether the draft model skips K_step = 0 steps, why not).

    ``enabled`` is the plugin config's ``zero_cost_fallback``.
    """
    spec = vllm_config.speculative_config
    if getattr(spec, "method", None) != "draft_model":
        return False, "the method is not draft_model"
    if not enabled:
        return False, "zero_cost_fallback is off in the plugin config"
    if not uses_plugin_scheduler(vllm_config):
        return False, "the scheduler is not vllm_specplug's"
    if k_step_pinned_for(vllm_config):
        return False, "K_step is pinned (data parallelism)"
    par = vllm_config.parallel_config
    if (getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        return False, "pipeline parallelism"
    if not _on_cpu():
        return False, "only checked on vLLM's CPU (V1) model runner"
    model = vllm_config.model_config
    draft = getattr(spec, "draft_model_config", None)
    if draft is not None and _vocab(draft) != _vocab(model):
        return False, "the draft's vocabulary differs from the target's"
    if getattr(model, "is_multimodal_model", False) or getattr(model, "uses_mrope", False):
        return False, "multimodal / M-RoPE inputs"
    return True, ""


def plugin_zero_cost_fallback(vllm_config) -> tuple[bool, str]:
    """``zero_cost_fallback_for`` with the flag read from the plugin's config section."""
    from vllm_specplug.config import SpecPlugConfig

    n = int(getattr(vllm_config.speculative_config, "num_speculative_tokens", 0) or 0)
    try:
        plug = SpecPlugConfig.from_additional_config(vllm_config.additional_config or {}, n)
    except Exception as exc:  # the scheduler reports a bad config at start-up
        return False, f"plugin config unavailable ({exc})"
    return zero_cost_fallback_for(vllm_config, plug.zero_cost_fallback)
