"""The thin vLLM adapter: a scheduler that asks the controller for K.

Select it with ``--scheduler-cls vllm_specplug.AdaptiveSpecScheduler`` (or
``LLM(scheduler_cls=...)``).  Every override calls ``super()``; no vLLM
method body is copied.  What each override adds:

- ``add_request`` / ``_free_request``: register a request with the
  controller (with its ``specplug_max_k`` ceiling) and free its state.
- ``_update_after_schedule`` (the end of ``schedule()``): ask the controller
  for this step's plan, set ``num_spec_tokens_to_schedule`` (K_step: how many
  draft positions the proposer runs at the end of the step), and remember
  each request's k_r.  In async mode the per-request placeholders are sized
  to k_r here, as vLLM sizes them to K_step.
- ``update_draft_token_ids`` (sync mode): trim each request's fresh drafts to
  its k_r before vLLM stores them, so only those are verified next step.
- ``update_from_output``: before vLLM consumes the output, read drafted and
  accepted counts per request and the step's duration, and feed them to the
  controller.

Verification stays vLLM's: only the number of drafts offered changes, so
output is identical to plain decoding.  Any exception inside the controller
is caught here, logged once with its traceback, and the step proceeds with
vLLM's own behaviour (static K), so a controller bug never fails a request.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from vllm_specplug.compat import effective_k_step
from vllm_specplug.deployment import (
    DRAFT_MODEL_METHODS,
    REPORT_ATTR,
    STOP_RULE_ATTR,
    ZERO_COST_OUTPUT_ATTR,
    Deployment,
    catch_up_tokens,
    graph_note,
)
from vllm_specplug.config import (
    SpecPlugConfig,
    RequestArgs,
    SpecPlugRequestError,
    parse_request_args,
)
from vllm_specplug.controller import (UNKNOWN_DRAFT_RATIO, SpecController, StepProfile,
                                      prior_profile, warm_up)

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
        self.zero_cost_fallback = dep.zero_cost
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
        self.last_log = time.monotonic()
        self.last_logged: dict[str, int] | None = None
        self.metrics = self._make_metrics(vllm_config)
        self.trace = self._open_trace(vllm_config)
        self._placeholders = [[-1] * k for k in range(self.num_spec_tokens + 1)]
        # Per request whose draft skipped steps (zero-cost fallback), the
        # first position it skipped, so the controller can price the
        # catch-up (deployment.catch_up_tokens); the worker keeps the exact
        # state.
        self.stale_from: dict[str, int] = {}
        self.block_size = int(vllm_config.cache_config.block_size)
        self.catchup: dict[int, int] = {}
        self._confidence_state()

    def _confidence_state(self) -> None:
        """The draft-confidence stop (patches/draft_confidence.py): whether this
        deployment may use it, and what travels between worker and scheduler."""
        self.confidence_stop = (self.deployment.confidence_stop(self.is_async)
                                and not self.k_step_pinned)
        # Rules are sent once a worker's step output says it can stop (its
        # patch is installed and on): otherwise a deeper K_step would only
        # draft what is then trimmed.
        self.worker_confidence = False
        # Per request, from the last step's report: (drafts worth verifying,
        # their confidences); and the confidences of the drafts now offered.
        self.kept: dict[str, tuple[int, list]] = {}
        self.offered_conf: dict[str, list] = {}

    def reconfigure(self, overrides: dict[str, Any], pin_k_step: bool | None = None) -> None:
        """Rebuild the controller from the start-up config with ``overrides``.

        For benchmarks that compare policies on one engine (one engine start,
        policies interleaved).  The result is validated like the start-up
        config and the controller starts fresh, as on a new server.
        ``pin_k_step=True`` leaves K_step to vLLM (its batch-size table, or
        ``num_speculative_tokens``) and has the policy pick per-request K
        under it.  Only between runs: no request may be in flight.
        """
        from dataclasses import fields

        if not self.enabled:
            raise RuntimeError(f"vllm-specplug is inert here: {self.reason}")
        if self.controller.num_requests():
            raise RuntimeError("reconfigure() needs an idle engine: requests are in flight")
        # Relative to the start-up config, so successive calls do not stack.
        raw = {f.name: getattr(self.startup_config, f.name) for f in fields(SpecPlugConfig)}
        raw.update(overrides)
        config = SpecPlugConfig.from_dict(raw, self.num_spec_tokens)
        vllm_config = self.vllm_config
        self.config = config
        self.deployment = self.deployment.with_config(vllm_config, config)
        self.ceiling = config.ceiling(self.num_spec_tokens)
        if pin_k_step is not None:
            self.k_step_pinned = pin_k_step
            self.pin_reason = "reconfigured"
        if self.metrics is not None:
            self.metrics.flush(self.controller, self.faults)
        self.zero_cost_fallback = self.deployment.zero_cost
        self.profile = self._profile()
        self.controller = self._new_controller()
        if self.metrics is not None:
            self.metrics.controller_replaced(self.controller)
        self.planned, self.stale_from, self.catchup = {}, {}, {}
        self._confidence_state()
        self.sched_end.clear()
        self.predicted.clear()
        self.last_update_end = None
        if self.trace is not None:
            self.trace.close()
        self.trace = self._open_trace(vllm_config)

    def worker_zero_cost(self, on: bool) -> None:
        """The workers' zero-cost state, as the step's output reports it (rank 0's).

        A worker that gave up skipping (a failed catch-up) runs the draft's
        first pass at K_step = 0 from then on: K_step = 0 steps are priced
        with that pass and no catch-up is owed.  Requests that skipped steps
        before draft from KV the catch-up never repaired, so what was learnt
        of their acceptance no longer holds: it starts again from the pool.
        """
        if on == self.zero_cost_fallback or (on and not self.deployment.zero_cost):
            return
        self.zero_cost_fallback = on
        if on:
            self.profile = self._profile()
            self.controller.set_profile(self.profile)
            logger.info("vllm-specplug: the workers skip the draft at K_step = 0 again")
            return
        # The profile in use was the skipping one: its first pass now runs at K_step = 0 too.
        self.profile = self.controller.profile.with_first_pass_at_k0()
        self.controller.set_profile(self.profile)
        cold = list(self.stale_from)
        self.controller.forget_acceptance(cold)
        self.stale_from.clear()
        self.catchup.clear()
        logger.warning("vllm-specplug: a worker reports the zero-cost fallback off (its "
                       "catch-up failed; see its log): K_step = 0 steps are priced with the "
                       "draft's first pass, and %d requests that skipped steps learn their "
                       "acceptance anew", len(cold))

    def _new_controller(self) -> SpecController:
        return SpecController(self.config.controller_settings(self.num_spec_tokens),
                              profile=self.profile)

    def _profile(self) -> StepProfile:
        """The start-up profile measured for this engine, or one from parameter counts."""
        import vllm_specplug.profiling as profiling

        measured = profiling.attached(self.kv_cache_config)
        if measured is not None:
            if measured.meta.get("zero_cost_fallback") and not self.zero_cost_fallback:
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
                             draft_runs_at_k0=ratio is not None and not self.zero_cost_fallback)

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


class _AdaptiveSpecMixin:
    """Overrides shared by the sync and async adaptive schedulers."""

    specplug: AdaptiveSpecState

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.specplug = AdaptiveSpecState(self)
        sp = self.specplug
        if not sp.enabled:
            logger.warning("vllm-specplug: AdaptiveSpecScheduler inert: %s", sp.reason)
            return
        logger.info(
            "vllm-specplug: adaptive speculation on: method=%s policy=%s ceiling=%d "
            "K_step=%s scheduler=%s probes every %d-%d steps, zero-cost fallback %s, "
            "metrics %s, trace %s",
            sp.method, sp.config.policy, sp.ceiling,
            f"pinned ({sp.pin_reason})" if sp.k_step_pinned else "adaptive",
            "async" if sp.is_async else "sync", sp.config.probe_interval,
            sp.config.probe_max_interval,
            "on" if sp.zero_cost_fallback else "off",
            "on" if sp.metrics is not None else "off",
            sp.config.trace_path or "off")

    # -- request lifecycle -------------------------------------------------
    def add_request(self, request) -> None:
        # A known id is a streaming-input session's next chunk or its end:
        # vLLM applies the chunk (``_update_request_as_session``, now or
        # when the current one ends) or finishes the session (then
        # ``_free_request`` frees the controller's row).  Only a new id
        # gets a row.
        new = request.request_id not in self.requests
        super().add_request(request)
        sp = self.specplug
        if not sp.enabled or not new or request.request_id not in self.requests:
            return
        try:
            args = self._specplug_args(request.request_id, request.sampling_params)
            sp.controller.add_request(request.request_id, args.max_k, args.k)
        except Exception:
            sp.fault("add_request")

    def _update_request_as_session(self, session, update) -> None:
        super()._update_request_as_session(session, update)
        sp = self.specplug
        if not sp.enabled or update.sampling_params is None:
            return
        try:  # the chunk's own specplug_max_k and specplug_k, or the server's
            args = self._specplug_args(session.request_id, update.sampling_params)
            sp.controller.set_ceiling(session.request_id,
                                      sp.ceiling if args.max_k is None else args.max_k, args.k)
        except Exception:
            sp.fault("session update")

    def _specplug_args(self, request_id: str, params) -> RequestArgs:
        sp = self.specplug
        try:
            return parse_request_args(getattr(params, "extra_args", None), sp.ceiling)
        except SpecPlugRequestError as exc:
            # The front end rejects these with HTTP 400; reaching here means a
            # caller bypassed it.  Never fail the engine over it.
            logger.warning("vllm-specplug: request %s: %s; adaptive under the server ceiling",
                           request_id, exc)
            return RequestArgs(None, None)

    def _free_request(self, request, *args, **kwargs):
        result = super()._free_request(request, *args, **kwargs)
        sp = self.specplug
        if sp.enabled:
            sp.planned.pop(request.request_id, None)
            sp.stale_from.pop(request.request_id, None)
            sp.offered_conf.pop(request.request_id, None)
            try:
                sp.controller.finish_request(request.request_id)
                if sp.metrics is not None and sp.controller.num_requests() == 0:
                    sp.metrics.flush(sp.controller, sp.faults)  # the engine goes idle
            except Exception:
                sp.fault("free_request")
        return result

    # -- deciding ----------------------------------------------------------
    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)
        sp = self.specplug
        if not sp.enabled:
            return
        try:
            self._specplug_plan(scheduler_output)
        except Exception:
            sp.planned = {}
            sp.fault("schedule")
        if len(sp.sched_end) > 8:
            sp.sched_end.clear()  # outputs that never came back (aborted steps)
            sp.predicted.clear()
            sp.catchup.clear()
        sp.sched_end[id(scheduler_output)] = sp.clock()

    def _specplug_plan(self, scheduler_output) -> None:
        sp = self.specplug
        requests = self.requests
        decoding = [rid for rid in scheduler_output.num_scheduled_tokens
                    if not requests[rid].is_prefill_chunk]
        spec_tokens = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        base_tokens = scheduler_output.total_num_scheduled_tokens - spec_tokens
        vllm_k_step = scheduler_output.num_spec_tokens_to_schedule
        stale = sp.stale_from
        scheduled = scheduler_output.num_scheduled_tokens
        catchup = 0
        if stale:
            # num_computed_tokens already counts this step's tokens.
            catchup = sum(catch_up_tokens(stale[rid], requests[rid].num_computed_tokens - n,
                                          sp.block_size)
                          for rid, n in scheduled.items() if rid in stale)
        # What would be pending a step later if this one skipped the draft.
        if_plain = (sum(catch_up_tokens(stale.get(rid, requests[rid].num_computed_tokens - n),
                                        requests[rid].num_computed_tokens, sp.block_size)
                        for rid, n in scheduled.items())
                    if sp.zero_cost_fallback else None)
        tokens_left = [int(requests[rid].max_tokens) - requests[rid].num_output_tokens
                       for rid in decoding]
        decision = sp.controller.plan(
            decoding,
            base_tokens=max(base_tokens, len(decoding)),
            fixed_k_step=vllm_k_step if sp.k_step_pinned else None,
            catchup_tokens=catchup,
            tokens_left=tokens_left,
            catchup_if_plain=if_plain,
        )
        k_step = min(int(decision.k_step), sp.num_spec_tokens)
        if sp.k_step_pinned:
            k_step = vllm_k_step
        caps = decision.k
        rule = (sp.controller.stop_rule() if sp.confidence_stop and sp.worker_confidence
                else None)
        if rule is not None:
            # The draft loop may run to the deepest ceiling; the worker stops
            # it where the next position does not pay (DraftStopper).
            caps = rule.caps
            k_step = min(max(k_step, int(caps.max(initial=0))), sp.num_spec_tokens)
        planned = dict(zip(decoding, (min(k, k_step) for k in caps.tolist())))
        # vLLM sized every decoding request's placeholders to its K_step;
        # under async scheduling they are resized to the request's own k_r
        # (never above K_step: a larger placeholder would read another
        # request's drafts).  Built before anything is changed.
        placeholders = ({rid: sp.placeholder(k) for rid, k in planned.items()}
                        if sp.is_async else {})
        # Everything above may fail and leaves vLLM's plan as it was; from
        # here on only assignments, vLLM's state together with the plugin's.
        scheduler_output.num_spec_tokens_to_schedule = k_step
        if rule is not None:
            setattr(scheduler_output, STOP_RULE_ATTR, rule)
        for rid, ids in placeholders.items():
            requests[rid].spec_token_ids = ids
        sp.planned = planned
        if sp.zero_cost_fallback:
            if k_step == 0:
                for rid, n in scheduled.items():
                    if rid not in stale:
                        stale[rid] = requests[rid].num_computed_tokens - n
            elif stale:
                for rid in scheduled:
                    stale.pop(rid, None)
                if catchup:
                    sp.catchup[id(scheduler_output)] = catchup
        sp.step += 1
        sp.predicted[id(scheduler_output)] = decision.predicted_seconds
        # Reporting, after the plan is applied: a failure here is counted
        # and the step runs as planned.
        try:
            if sp.metrics is not None:
                sp.metrics.record_step(effective_k_step(scheduler_output))
            if sp.trace is not None:
                sp.trace.plan(sp.step, decision, decoding, sp.controller, k_step)
        except Exception:
            sp.fault("report")

    def update_draft_token_ids(self, draft_token_ids) -> None:
        sp = self.specplug
        if sp.enabled and (sp.planned or sp.kept):
            try:
                planned, kept = sp.planned, sp.kept
                trimmed = []
                for rid, ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
                    k = planned.get(rid)
                    worth = kept.get(rid)
                    if worth is not None:
                        # The worker's stop: the drafts worth verifying, and
                        # their confidences, for the calibration.
                        k = worth[0] if k is None else min(k, worth[0])
                        sp.offered_conf[rid] = worth[1][:k]
                    else:
                        sp.offered_conf.pop(rid, None)
                    trimmed.append(ids[:k] if k is not None and len(ids) > k else ids)
                draft_token_ids = DraftTokenIds(draft_token_ids.req_ids, trimmed)
                sp.kept = {}
            except Exception:
                sp.fault("update_draft_token_ids")
        super().update_draft_token_ids(draft_token_ids)

    # -- learning ----------------------------------------------------------
    def update_from_output(self, scheduler_output, model_runner_output):
        sp = self.specplug
        if sp.enabled:
            try:
                self._specplug_observe(scheduler_output, model_runner_output)
            except Exception:
                sp.fault("update_from_output")
        return super().update_from_output(scheduler_output, model_runner_output)

    def _specplug_observe(self, scheduler_output, model_runner_output) -> None:
        sp = self.specplug
        now = sp.clock()
        reported = getattr(model_runner_output, ZERO_COST_OUTPUT_ATTR, None)
        if reported is not None and reported != sp.zero_cost_fallback:
            sp.worker_zero_cost(reported)
        report = getattr(model_runner_output, REPORT_ATTR, None)
        if report is not None:
            sp.worker_confidence = bool(report.on)
            sp.kept = report.kept
        conf_ids: list[str] = []
        confs: list[list] = []
        confs_accepted: list[int] = []
        ctrl = sp.controller
        sampled = model_runner_output.sampled_token_ids
        index = sp.runner.index(model_runner_output)
        is_async = sp.is_async
        rids: list[str] = []
        drafted: list[int] = []
        accepted: list[int] = []
        verified: dict[str, list[int]] | None = {} if sp.trace is not None else None
        # Drafts that structured output found against the grammar were padded
        # with -1 and never offered (async scheduling); vLLM leaves them out
        # of its own counts, and they say nothing about the draft's agreement.
        invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None) or {}
        for rid, spec in scheduler_output.scheduled_spec_decode_tokens.items():
            if not spec:
                continue
            idx = index.get(rid)
            if idx is None or not sampled or idx >= len(sampled) or len(sampled[idx]) == 0:
                continue
            offered = len(spec) - invalid.get(rid, 0)
            if verified is not None:
                verified[rid] = [offered, len(sampled[idx]) - 1]
            if sp.runner.real_drafts(spec, is_async) == 0 or offered <= 0:
                # V1, sync: vLLM's own padding placeholders, no draft behind them.
                continue
            conf = sp.offered_conf.pop(rid, None)
            if conf is not None and len(conf) >= offered:
                conf_ids.append(rid)
                confs.append(conf[:offered])
                confs_accepted.append(len(sampled[idx]) - 1)
            rids.append(rid)
            drafted.append(offered)
            accepted.append(len(sampled[idx]) - 1)
        if rids:
            ctrl.observe_verifications(rids, drafted, accepted)
        if confs:
            ctrl.observe_confidence(confs, confs_accepted)
        total = scheduler_output.total_num_scheduled_tokens
        sched_end = sp.sched_end.pop(id(scheduler_output), None)
        predicted = sp.predicted.pop(id(scheduler_output), None)
        measured = None
        if sched_end is not None and total > 0:
            # Sync: the step ran from the end of schedule() to now.  Async:
            # it could only start once the previous step had finished, so it
            # ran from the later of that and its own scheduling.
            start = sched_end if sp.last_update_end is None else max(sched_end, sp.last_update_end)
            measured = now - start
            passes = (report.passes if report is not None and report.passes is not None
                      else effective_k_step(scheduler_output))
            ctrl.observe_step(len(scheduler_output.num_scheduled_tokens), total, passes, measured,
                              sp.catchup.pop(id(scheduler_output), 0))
        sp.last_update_end = None if total == 0 or not is_async else now
        if verified is not None and (verified or measured is not None):
            sp.trace.verify(sp.step, measured, verified,
                            None if report is None else report.passes,
                            dict(zip(conf_ids, confs)) if confs else None)
        if sp.metrics is not None:
            if predicted is not None and measured is not None:
                sp.metrics.record_timing(predicted, measured)
            sp.metrics.maybe_flush(ctrl, sp.faults)
        if sp.config.log_interval_s > 0 and time.monotonic() - sp.last_log >= sp.config.log_interval_s:
            sp.last_log = time.monotonic()
            self._specplug_log_summary()

    def _specplug_log_summary(self) -> None:
        """One line, in vLLM's style, about the steps since the last line."""
        sp = self.specplug
        s = sp.controller.stats
        keys = ("steps", "sum_k_step", "request_steps", "granted_slots",
                "fallback_request_steps", "drafted", "accepted", "probes_sent",
                "probes_succeeded", "plain_probes")
        now = {k: getattr(s, k) for k in keys}
        prev = sp.last_logged or dict.fromkeys(keys, 0)
        sp.last_logged = now
        w = {k: now[k] - prev[k] for k in keys}
        if w["steps"] == 0:
            return  # idle since the last line
        req_steps = max(w["request_steps"], 1)
        d = sp.controller.last_decision
        speedup = d.predicted_speedup if d is not None else float("nan")
        logger.info(
            "vllm-specplug: mean K_step %.2f, mean k/request %.2f, fallback %.0f%% of "
            "request-steps, acceptance %.2f, predicted speedup %.2fx, probes %d (%d ok), "
            "plain probes %d, requests %d (%d in fallback)",
            w["sum_k_step"] / w["steps"], w["granted_slots"] / req_steps,
            100.0 * w["fallback_request_steps"] / req_steps,
            w["accepted"] / max(w["drafted"], 1), speedup, w["probes_sent"],
            w["probes_succeeded"], w["plain_probes"], sp.controller.num_requests(),
            sp.controller.num_in_fallback())


class SyncAdaptiveSpecScheduler(_AdaptiveSpecMixin, Scheduler):
    pass


class AsyncAdaptiveSpecScheduler(_AdaptiveSpecMixin, AsyncScheduler):
    pass


class AdaptiveSpecScheduler(SyncAdaptiveSpecScheduler):
    """Entry class: becomes the sync or async variant to match vLLM's config."""

    def __new__(cls, *args, **kwargs):
        if cls is AdaptiveSpecScheduler:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            sched_cfg = getattr(vllm_config, "scheduler_config", None)
            if getattr(sched_cfg, "async_scheduling", False):
                return AsyncAdaptiveSpecScheduler(*args, **kwargs)
        return super().__new__(cls)
