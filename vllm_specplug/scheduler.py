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

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from vllm_specplug.adapter_state import AdaptiveSpecState
from vllm_specplug.compat import effective_k_step
from vllm_specplug.config import RequestArgs, SpecPlugRequestError, parse_request_args
from vllm_specplug.deployment import REPORT_ATTR, STOP_RULE_ATTR, ZERO_COST_OUTPUT_ATTR

logger = logging.getLogger("vllm.specplug")


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
            "on" if sp.zero_cost.on else "off",
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
            sp.zero_cost.stale_from.pop(request.request_id, None)
            sp.confidence.offered.pop(request.request_id, None)
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
            sp.zero_cost.catchup.clear()
        sp.sched_end[id(scheduler_output)] = sp.clock()

    def _specplug_plan(self, scheduler_output) -> None:
        sp = self.specplug
        requests = self.requests
        decoding = [rid for rid in scheduler_output.num_scheduled_tokens
                    if not requests[rid].is_prefill_chunk]
        spec_tokens = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        base_tokens = scheduler_output.total_num_scheduled_tokens - spec_tokens
        vllm_k_step = scheduler_output.num_spec_tokens_to_schedule
        scheduled = scheduler_output.num_scheduled_tokens
        catchup, if_plain = sp.zero_cost.owed(requests, scheduled)
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
        rule = sp.confidence.rule(sp.controller, decision)
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
        sp.zero_cost.planned(id(scheduler_output), k_step, requests, scheduled, catchup)
        sp.step += 1
        sp.predicted[id(scheduler_output)] = decision.predicted_seconds
        # Reporting, after the plan is applied: a failure here is counted
        # and the step runs as planned.
        try:
            if sp.metrics is not None:
                sp.metrics.record_step(effective_k_step(scheduler_output))
            if sp.trace is not None:
                sp.trace.plan(sp.step, decision, decoding, k_step)
        except Exception:
            sp.fault("report")

    def update_draft_token_ids(self, draft_token_ids) -> None:
        sp = self.specplug
        if sp.enabled and (sp.planned or sp.confidence.kept):
            try:
                trimmed = sp.confidence.trim(sp.planned, draft_token_ids.req_ids,
                                             draft_token_ids.draft_token_ids)
                draft_token_ids = DraftTokenIds(draft_token_ids.req_ids, trimmed)
                sp.confidence.kept = {}
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
        if reported is not None and reported != sp.zero_cost.on:
            profile = sp.zero_cost.worker_reports(reported, sp.deployment.zero_cost,
                                                  sp.controller, sp._profile)
            if profile is not None:
                sp.profile = profile
        report = getattr(model_runner_output, REPORT_ATTR, None)
        if report is not None:
            sp.confidence.worker_report(report)
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
            conf = sp.confidence.offered.pop(rid, None)
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
                              sp.zero_cost.take_catchup(id(scheduler_output)))
        sp.last_update_end = None if total == 0 or not is_async else now
        if verified is not None and (verified or measured is not None):
            sp.trace.verify(sp.step, measured, verified,
                            None if report is None else report.passes,
                            dict(zip(conf_ids, confs)) if confs else None)
        if sp.metrics is not None:
            if predicted is not None and measured is not None:
                sp.metrics.record_timing(predicted, measured)
            sp.metrics.maybe_flush(ctrl, sp.faults)
        sp.summary.maybe_log(ctrl, sp.config.log_interval_s)


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
