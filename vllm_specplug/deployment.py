"""What a deployment's vLLM config means for the plugin, asked alike by the scheduler and workers.

The scheduler prices steps by whether the draft model skips K_step = 0 steps
(zero-cost fallback); the workers' patch (``patches/draft_model_skip.py``)
does the skipping.  Both ask ``zero_cost_fallback_for`` here, so they cannot
disagree on anything the config decides.  What only a worker can see (its
model runner, the draft's attention groups) it checks itself, and says
loudly when it cannot honour what the config promised; each step's output
tells the scheduler what the worker actually does (``ZERO_COST_OUTPUT_ATTR``).
``Deployment.settle`` gathers every such answer once per engine core.

Config only: this module imports neither the scheduler nor the controller,
so a worker asks without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_specplug.config import SpecPlugConfig
    from vllm_specplug.runners import RunnerAdapter

DRAFT_MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "mtp", "medusa"})

_PACKAGE = "vllm_specplug."

# The attribute of vLLM's ModelRunnerOutput by which a worker reports each
# step whether it skips the draft at K_step = 0 (set by the patch, read by
# the scheduler: the workers' actual state, not the config's promise).
ZERO_COST_OUTPUT_ATTR = "specplug_zero_cost"
# The draft-confidence stop (patches/draft_confidence.py): the SchedulerOutput
# attribute carrying the step's StopRule, and the ModelRunnerOutput attribute
# carrying the worker's DraftReport.
STOP_RULE_ATTR = "specplug_stop_rule"
REPORT_ATTR = "specplug_draft_report"


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


def pin_reason(vllm_config) -> str | None:
    """Why K_step must stay at num_speculative_tokens here, or None (it adapts).

    Data-parallel ranks, which may step in lockstep (MoE): a different
    number of draft passes per rank would hang their collectives (vLLM
    tells each engine of a dense model data_parallel_size=1); a batch-size
    table of K of the user's (``num_speculative_tokens_per_batch_size``);
    and proposers that need a fixed K, or that run every position whatever
    K_step says (``runners.RunnerAdapter.drafter_follows_k_step``: a
    smaller K_step would save them nothing).
    """
    from vllm_specplug.runners import runner_for

    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    dp = getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1
    if dp > 1:
        return "data_parallel_size > 1: ranks step in lockstep"
    # A batch-size table of the user's (vLLM's dynamic K) sets K_step itself.
    if getattr(spec, "num_speculative_tokens_per_batch_size", None):
        return "num_speculative_tokens_per_batch_size sets K_step"
    runner = runner_for(vllm_config)
    if not runner.drafter_follows_k_step(method):
        if runner.is_v2:
            return (f"the {runner.name} runner's {method} speculator drafts every position "
                    f"whatever K_step says")
        return f"method {method!r} needs a fixed K"
    return None


def runner_refusal(vllm_config) -> str | None:
    """Why the plugin leaves this engine to vLLM's own behaviour, or None."""
    from vllm_specplug.runners import runner_for

    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "enable_adaptive_verification", False):
        # One controller per K: vLLM's trims each request's drafts on the
        # device after the scheduler's choice, and the trimmed drafts reach
        # the scheduler as rejections, which the plugin would learn as such.
        return ("vLLM's adaptive verification is on (enable_adaptive_verification): it "
                "decides how many drafts each request verifies, so the plugin leaves K to "
                "vLLM")
    if runner_for(vllm_config).supported:
        return None
    return ("this platform's model runner is not one the plugin was checked against "
            "(CPU or CUDA, V1 or V2); vLLM's own speculative decoding runs unchanged "
            "(every request drafts num_speculative_tokens)")


def graph_note(vllm_config) -> str | None:
    """What CUDA graphs the plugin's steps lose on this engine, or None.

    On the GPU runners vLLM captures full decode graphs for steps where every
    request verifies the same number of drafts, K (V1:
    ``uniform_decode_query_len``; V2: ``get_decode_cudagraph_query_lens``,
    per K only with vLLM's own K table).  A step the plugin plans at a
    smaller K_step, or with fewer drafts for some request, runs piecewise
    graphs (or none under ``FULL_DECODE_ONLY``), as vLLM's own dynamic K
    does; on V2 a draft loop captured whole for K still replays all K
    positions.  The user is told once."""
    runner = model_runner(vllm_config)
    if runner not in ("gpu-v1", "gpu-v2"):
        return None
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(comp, "cudagraph_mode", None), "name", "NONE")
    if mode in ("NONE", None):
        return None
    return (f"CUDA graph mode {mode} on the {runner} runner: steps where the plugin drafts "
            f"fewer than num_speculative_tokens for some request run without full CUDA "
            f"graphs (piecewise or eager), as vLLM's own dynamic K; the start-up profile "
            f"times them as they run and the policy prices them so")


def model_runner(vllm_config) -> str:
    """The workers' model runner (``runners.model_runner_name``)."""
    from vllm_specplug.runners import model_runner_name

    return model_runner_name(vllm_config)


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
    if model_runner(vllm_config) != "cpu-v1":
        return False, "the patch exists for vLLM's CPU V1 model runner only"
    pinned = pin_reason(vllm_config)
    if pinned:
        return False, f"K_step is pinned ({pinned})"
    par = vllm_config.parallel_config
    if (getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        return False, "pipeline parallelism"
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


@dataclass(frozen=True)
class Deployment:
    """What one engine core's vLLM config means for the plugin, settled once at start-up.

    The start-up profile (``profiling.profile_for_engine``) settles it and
    hands it to the scheduler with the profile (``profiling.attach``); a
    scheduler built without the profile's run settles it itself.  Workers,
    in their own processes, ask ``plugin_zero_cost_fallback`` the same
    question from the same config.
    """

    runner: RunnerAdapter
    method: str | None
    num_spec_tokens: int
    config: SpecPlugConfig
    # Why the plugin leaves K to vLLM here (None: it adapts).
    inert: str | None
    # Why K_step stays at num_speculative_tokens (None: it adapts).
    pin_reason: str | None
    zero_cost: bool
    zero_cost_why: str
    tensor_parallel: int

    @classmethod
    def settle(cls, vllm_config: Any, config: SpecPlugConfig | None = None) -> Deployment:
        """``config``: the plugin's config; default: parsed (and validated) from
        ``additional_config["specplug"]``, which raises on a bad key."""
        from vllm_specplug.config import SpecPlugConfig
        from vllm_specplug.runners import runner_for

        spec = vllm_config.speculative_config
        n = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        if config is None:
            config = SpecPlugConfig.from_additional_config(
                getattr(vllm_config, "additional_config", None) or {}, n)
        runner = runner_for(vllm_config)
        if spec is None or n <= 0:
            return cls(runner, None, 0, config, "no speculative config: nothing to adapt, the "
                       "scheduler behaves exactly like vLLM's", None, False, "no speculation", 1)
        zero_cost, why = zero_cost_fallback_for(vllm_config, config.zero_cost_fallback)
        par = vllm_config.parallel_config
        return cls(runner, getattr(spec, "method", None), n, config, runner_refusal(vllm_config),
                   pin_reason(vllm_config), zero_cost, why,
                   int(getattr(par, "tensor_parallel_size", 1) or 1))

    def with_config(self, vllm_config: Any, config: SpecPlugConfig) -> Deployment:
        """The same engine under another plugin config (benchmarks' ``reconfigure``)."""
        zero_cost, why = zero_cost_fallback_for(vllm_config, config.zero_cost_fallback)
        return replace(self, config=config, zero_cost=zero_cost, zero_cost_why=why)

    @property
    def k_step_pinned(self) -> bool:
        return self.pin_reason is not None

    def confidence_stop(self, is_async: bool) -> bool:
        """Whether the draft-confidence stop (``patches/draft_confidence.py``) applies."""
        c = self.config
        return (c.draft_confidence and c.policy == "goodput" and self.method == "draft_model"
                and self.runner.worker_patches and not is_async and not self.k_step_pinned
                and self.tensor_parallel == 1)
