"""The adapter's state per scheduler: config, controller, plan, and what it reports.

``AdaptiveSpecState`` is built by the scheduler (``scheduler.py``) and holds
everything the overrides read and write: the settled ``Deployment``, the
controller and its profile, the plan in flight, step timing, metrics, the
decision trace, the zero-cost fallback's bookkeeping (``zero_cost.py``) and
the draft-confidence round trip (``confidence_stop.py``).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specplug.confidence_stop import ConfidenceStop
from vllm_specplug.controller import (UNKNOWN_DRAFT_RATIO, SpecController, StepProfile,
                                      prior_profile, warm_up)
from vllm_specplug.deployment import DRAFT_MODEL_METHODS, Deployment, graph_note
from vllm_specplug.metrics_log import SummaryLog
from vllm_specplug.zero_cost import ZeroCostBook

logger = logging.getLogger("vllm.specplug")


def _approx_params(hf_config: Any) -> float:
    """Rough parameter count from a Hugging Face config (for the cost prior)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = getattr(text, "hidden_size", 0) or 0
    layers = getattr(text, "num_hidden_layers", 0) or 0
    inter = getattr(text, "intermediate_size", 0) or 4 * hidden
    vocab = getattr(text, "vocab_size", 0) or 0
    return float(layers * (4 * hidden * hidden + 3 * hidden * inter) + vocab * hidden)


def dp_index(parallel_config) -> int:
    """This engine's data-parallel rank, for metric labels and file names.

    An independent (dense-model) DP engine is told ``data_parallel_rank=0``;
    ``data_parallel_index`` keeps its real rank (vLLM 0.32)."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


class AdaptiveSpecState:
    """Everything the adapter keeps per scheduler: config, controller, plan."""

    def __init__(self, scheduler: Scheduler) -> None:
        vllm_config = scheduler.vllm_config
        self.enabled = False
        self.reason = ""
        self.num_spec_tokens = int(getattr(scheduler, "num_spec_tokens", 0) or 0)
        self.vllm_config = vllm_config
        # The start-up profile and the deployment it was measured for travel
        # on the KV cache config the engine core builds this scheduler from
        # (profiling.attach); without them the deployment is settled here.
        # Either way the plugin's config is validated, even when inert, so a
        # typo is never silently ignored.
        self.kv_cache_config = scheduler.kv_cache_config
        import vllm_specplug.profiling as profiling

        dep = profiling.attached_deployment(self.kv_cache_config) or Deployment.settle(vllm_config)
        self.deployment = dep
        self.config = self.startup_config = dep.config
        self.method = dep.method
        self.runner = dep.runner
        if dep.method is None or self.num_spec_tokens <= 0:
            self.reason = dep.inert or "no speculative config"
            return
        from vllm_specplug.plugin import missing_features

        missing = missing_features()
        if missing:
            self.reason = f"vLLM lacks {', '.join(missing)}"
            return
        if dep.inert:
            self.reason = dep.inert
            return
        graphs = graph_note(vllm_config)
        if graphs:
            logger.warning("vllm-specplug: %s", graphs)
        self.ceiling = self.config.ceiling(self.num_spec_tokens)
        # K_step stays at num_speculative_tokens where a smaller one would
        # hang lockstep ranks' collectives or save the proposer nothing
        # (deployment.pin_reason); each request's k adapts under it.
        self.pin_reason = dep.pin_reason or ""
        self.k_step_pinned = dep.k_step_pinned
        self.is_async = isinstance(scheduler, AsyncScheduler)
        # Zero-cost fallback (patches/draft_model_skip.py): the worker skips
        # the draft model at K_step=0 and catches up before the next K_step>0.
        # Known before the controller is built: it shapes the prior profile.
        self.block_size = int(vllm_config.cache_config.block_size)
        self.zero_cost = ZeroCostBook(dep.zero_cost, self.block_size)
        self.profile = self._profile()
        self.controller = self._new_controller()
        warm_up(self.controller.settings, self.profile)
        self.enabled = True
        self.planned: dict[str, int] = {}
        # End of schedule() per SchedulerOutput still in flight (async keeps
        # up to two), and the end of the last update in async mode.
        self.sched_end: dict[int, float] = {}
        self.last_update_end: float | None = None
        # Step timing source; tests substitute a synthetic clock.
        self.clock = time.perf_counter
        self.faults = 0
        self.step = 0
        # Predicted seconds of each step still in flight, for calibration.
        self.predicted: dict[int, float] = {}
        self.summary = SummaryLog()
        self.metrics = self._make_metrics(vllm_config)
        self.trace = self._open_trace(vllm_config)
        self._placeholders = [[-1] * k for k in range(self.num_spec_tokens + 1)]
        self._confidence_state()

    def _confidence_state(self) -> None:
        """The draft-confidence stop (patches/draft_confidence.py): whether this
        deployment may use it, and what travels between worker and scheduler."""
        self.confidence = ConfidenceStop(self.deployment.confidence_stop(self.is_async)
                                         and not self.k_step_pinned)

    def _new_controller(self) -> SpecController:
        return SpecController(self.config.controller_settings(self.num_spec_tokens),
                              profile=self.profile)

    def _profile(self) -> StepProfile:
        """The start-up profile measured for this engine, or one from parameter counts."""
        import vllm_specplug.profiling as profiling

        measured = profiling.attached(self.kv_cache_config)
        if measured is not None:
            if measured.meta.get("zero_cost_fallback") and not self.zero_cost.on:
                # Measured skipping the draft at K_step = 0; here it runs then too.
                return measured.with_first_pass_at_k0()
            return measured
        vllm_config, spec = self.vllm_config, self.vllm_config.speculative_config
        ratio = None
        if self.method in DRAFT_MODEL_METHODS:
            ratio = UNKNOWN_DRAFT_RATIO
            try:
                draft = _approx_params(spec.draft_model_config.hf_config)
                target = _approx_params(vllm_config.model_config.hf_config)
                if draft > 0 and target > 0:
                    ratio = draft / target
            except Exception:
                pass
        try:
            from vllm.platforms import current_platform

            platform = str(getattr(current_platform, "device_type", "") or "cpu")
        except Exception:
            platform = "cpu"
        sched = vllm_config.scheduler_config
        if self.config.policy == "goodput":
            why = ('profile is "off"' if self.config.profile == "off" else
                   "K_step is pinned" if self.k_step_pinned else
                   "no start-up measurement ran in this process")
            logger.info("vllm-specplug: no measured step-cost profile (%s); prices from "
                        "parameter counts", why)
        return prior_profile(platform, ratio, int(sched.max_num_batched_tokens),
                             int(sched.max_num_seqs),
                             draft_runs_at_k0=ratio is not None and not self.zero_cost.on)

    def _make_metrics(self, vllm_config):
        try:
            from vllm_specplug.metrics import SpecPlugMetrics

            names = getattr(vllm_config.model_config, "served_model_name", None)
            name = names[0] if isinstance(names, (list, tuple)) and names else (
                names or vllm_config.model_config.model)
            return SpecPlugMetrics(str(name), dp_index(vllm_config.parallel_config),
                                   self.ceiling)
        except Exception:
            logger.warning("vllm-specplug: Prometheus metrics unavailable, serving goes "
                           "on without them:\n%s", traceback.format_exc())
            return None

    def _open_trace(self, vllm_config):
        path = self.config.trace_path
        if not path:
            return None
        from vllm_specplug.trace import DecisionTrace

        rank = dp_index(vllm_config.parallel_config)
        if rank > 0:  # rank 0 keeps the path as given
            path = f"{path}.rank{rank}"
        try:
            trace = DecisionTrace(path)
        except OSError as exc:
            from vllm_specplug.config import SpecPlugConfigError

            raise SpecPlugConfigError(
                f'additional_config["specplug"].trace_path = {path!r} cannot be '
                f"opened for writing: {exc}") from exc
        logger.info("vllm-specplug: writing the decision trace to %s", path)
        return trace

    def placeholder(self, k: int) -> list[int]:
        # Shared read-only lists: vLLM slices (copies) spec_token_ids before
        # it writes anything, so no list is mutated in place.
        return self._placeholders[k]

    def fault(self, where: str) -> None:
        self.faults += 1
        if self.faults == 1:
            logger.error(
                "vllm-specplug: controller failed in %s; this step uses vLLM's own K "
                "(static) and serving continues. Further failures are counted, not "
                "logged.\n%s", where, traceback.format_exc())
