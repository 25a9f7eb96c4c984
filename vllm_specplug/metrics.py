"""The controller's state as Prometheus series on vLLM's ``/metrics``.

The controller lives in vLLM's engine-core process; ``/metrics`` is served by
the API process.  The supported path between them is prometheus_client's
multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set (``vllm-specplug
serve`` sets a fresh one; vLLM itself does with several API servers), every
process writes its series to files there and vLLM's ``/metrics`` collects
them.  Without it the series live in the default registry: in one process
(the ``LLM`` class) that is what ``LLM.get_metrics()`` reads, and an engine
core in a child process (plain ``vllm serve``) also writes them to a
snapshot that its API server serves (``metrics_bridge``).

Drafted and accepted token counts are vLLM's own (``vllm:spec_decode_*``);
nothing here duplicates them.  Series, all labelled ``model_name`` and
``engine`` like vLLM's:

- ``vllm:specplug_steps_total{k_step}``: steps by the number of draft
  positions the proposer ran (K_step);
- ``vllm:specplug_request_steps_total{k}``: decode request-steps by drafts
  granted to the request (k = 0 is fallback or a ceiling of 0);
- ``vllm:specplug_requests`` / ``vllm:specplug_requests_in_fallback``;
- ``vllm:specplug_probes_total`` / ``vllm:specplug_probes_succeeded_total`` /
  ``vllm:specplug_recoveries_total``;
- ``vllm:specplug_plain_probes_total``: runs of plain steps that measure a
  batch size's plain step where the plan always drafts;
- ``vllm:specplug_predicted_step_seconds_total`` and
  ``vllm:specplug_measured_step_seconds_total`` over the same steps (their
  rates' ratio is the cost model's calibration);
- ``vllm:specplug_estimated_acceptance{position}``: pooled conditional
  acceptance per draft position;
- ``vllm:specplug_predicted_speedup``: of the last plan, over plain decoding;
- ``vllm:specplug_controller_faults_total``.

Series are updated from counters the controller keeps anyway, at most every
``FLUSH_INTERVAL_S`` (``maybe_flush``), and by the scheduler when its last
request is freed (``flush``), not per step.
"""

from __future__ import annotations

import time

import numpy as np

FLUSH_INTERVAL_S = 0.5
_LABELS = ("model_name", "engine")
_SERIES: dict[str, object] = {}


def _series():
    """The metric objects, created once per process and (re)registered.

    vLLM unregisters every ``vllm:`` collector from the default registry
    when an engine starts in a process that already had one; put ours back.
    """
    from prometheus_client import REGISTRY, Counter, Gauge

    if not _SERIES:
        s = _SERIES
        s["steps"] = Counter("vllm:specplug_steps", "Steps by K_step, the draft "
                             "positions the proposer ran.", _LABELS + ("k_step",))
        s["request_steps"] = Counter("vllm:specplug_request_steps", "Decode request-steps "
                                     "by drafts granted to the request.", _LABELS + ("k",))
        s["requests"] = Gauge("vllm:specplug_requests", "Requests the controller tracks.",
                              _LABELS, multiprocess_mode="livesum")
        s["fallback"] = Gauge("vllm:specplug_requests_in_fallback", "Requests granted no "
                              "drafts although their ceiling allows some.", _LABELS,
                              multiprocess_mode="livesum")
        s["probes"] = Counter("vllm:specplug_probes", "Re-probes of requests in fallback.",
                              _LABELS)
        s["probes_ok"] = Counter("vllm:specplug_probes_succeeded", "Re-probes whose drafts "
                                 "were all accepted.", _LABELS)
        s["plain_probes"] = Counter("vllm:specplug_plain_probes", "Runs of plain steps "
                                    "measuring a batch size's plain step.", _LABELS)
        s["recoveries"] = Counter("vllm:specplug_recoveries", "Requests that left fallback "
                                  "after a successful probe.", _LABELS)
        s["predicted_s"] = Counter("vllm:specplug_predicted_step_seconds", "Step time the "
                                   "cost model predicted, summed over measured steps.",
                                   _LABELS)
        s["measured_s"] = Counter("vllm:specplug_measured_step_seconds", "Step time "
                                  "measured, summed over the same steps.", _LABELS)
        s["acceptance"] = Gauge("vllm:specplug_estimated_acceptance", "Estimated conditional "
                                "acceptance per draft position, pooled over requests.",
                                _LABELS + ("position",), multiprocess_mode="mostrecent")
        s["speedup"] = Gauge("vllm:specplug_predicted_speedup", "Predicted goodput of the "
                             "last plan over plain decoding.", _LABELS,
                             multiprocess_mode="mostrecent")
        s["faults"] = Counter("vllm:specplug_controller_faults", "Controller exceptions "
                              "caught (the step used vLLM's own K).", _LABELS)
    for collector in _SERIES.values():
        try:
            REGISTRY.register(collector)
        except ValueError:
            pass  # already registered
    return _SERIES


class SpecPlugMetrics:
    """Exports one controller's counters as deltas, and its gauges."""

    def __init__(self, model_name: str, engine: int, max_k: int) -> None:
        self.labels = {"model_name": model_name, "engine": str(engine)}
        self.series = _series()
        self.max_k = max_k
        self._sent_k_step = np.zeros(max_k + 1, dtype=np.int64)
        self._sent_k = np.zeros(max_k + 1, dtype=np.int64)
        self._sent: dict[str, float] = {}
        self.k_step_counts = np.zeros(max_k + 1, dtype=np.int64)
        self.predicted_s = 0.0
        self.measured_s = 0.0
        self.last_flush = 0.0
        from vllm_specplug.metrics_bridge import SnapshotWriter

        # Plain `vllm serve` without a multiprocess dir: the API server reads
        # these series from a snapshot (metrics_bridge).
        self.snapshot = SnapshotWriter.for_this_process(str(engine))
        # Create every labelled child now so the series exist (at 0) from
        # start-up, not from the first event.
        for k in range(max_k + 1):
            self.series["steps"].labels(**self.labels, k_step=str(k))
            self.series["request_steps"].labels(**self.labels, k=str(k))
        for name in ("requests", "fallback", "probes", "probes_ok", "recoveries",
                     "plain_probes", "predicted_s", "measured_s", "faults"):
            self.series[name].labels(**self.labels)

    def controller_replaced(self, controller) -> None:
        """Another controller took over (``reconfigure``): count on from its
        counters instead of seeing negative (or repeated) increments."""
        stats = controller.stats
        self._sent_k = stats.k_counts.copy()
        self._sent["probes"] = stats.probes_sent
        self._sent["probes_ok"] = stats.probes_succeeded
        self._sent["recoveries"] = stats.recoveries
        self._sent["plain_probes"] = stats.plain_probes

    def record_step(self, k_step: int) -> None:
        self.k_step_counts[min(max(k_step, 0), self.max_k)] += 1

    def record_timing(self, predicted: float, measured: float) -> None:
        if predicted > 0 and measured > 0:
            self.predicted_s += predicted
            self.measured_s += measured

    def maybe_flush(self, controller, faults: int) -> None:
        now = time.monotonic()
        if now - self.last_flush >= FLUSH_INTERVAL_S:
            self.last_flush = now
            self.flush(controller, faults)

    def _inc(self, name: str, total: float) -> None:
        delta = total - self._sent.get(name, 0)
        if delta > 0:
            self.series[name].labels(**self.labels).inc(delta)
            self._sent[name] = total

    def flush(self, controller, faults: int) -> None:
        s, lab = self.series, self.labels
        for k in np.flatnonzero(self.k_step_counts != self._sent_k_step).tolist():
            s["steps"].labels(**lab, k_step=str(k)).inc(
                int(self.k_step_counts[k] - self._sent_k_step[k]))
        self._sent_k_step = self.k_step_counts.copy()
        counts = controller.stats.k_counts
        for k in np.flatnonzero(counts != self._sent_k).tolist():
            s["request_steps"].labels(**lab, k=str(k)).inc(int(counts[k] - self._sent_k[k]))
        self._sent_k = counts.copy()
        stats = controller.stats
        self._inc("probes", stats.probes_sent)
        self._inc("probes_ok", stats.probes_succeeded)
        self._inc("recoveries", stats.recoveries)
        self._inc("plain_probes", stats.plain_probes)
        self._inc("predicted_s", self.predicted_s)
        self._inc("measured_s", self.measured_s)
        self._inc("faults", faults)
        s["requests"].labels(**lab).set(controller.num_requests())
        s["fallback"].labels(**lab).set(controller.num_in_fallback())
        for p, a in enumerate(controller.estimator.global_profile().tolist(), start=1):
            s["acceptance"].labels(**lab, position=str(p)).set(a)
        d = controller.last_decision
        if d is not None and np.isfinite(d.predicted_speedup):
            s["speedup"].labels(**lab).set(d.predicted_speedup)
        if self.snapshot is not None:
            self.snapshot.write(s.values())
