"""The scheduler's summary log line, in vLLM's style, every ``log_interval_s``."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("vllm.specplug")

_KEYS = ("steps", "sum_k_step", "request_steps", "granted_slots",
         "fallback_request_steps", "drafted", "accepted", "probes_sent",
         "probes_succeeded", "plain_probes")


class SummaryLog:
    """One line about the steps since the last line, from the controller's counters."""

    def __init__(self) -> None:
        self.last_log = time.monotonic()
        self.last_logged: dict[str, int] | None = None

    def maybe_log(self, controller, interval_s: float) -> None:
        if interval_s > 0 and time.monotonic() - self.last_log >= interval_s:
            self.last_log = time.monotonic()
            self.log(controller)

    def log(self, controller) -> None:
        s = controller.stats
        now = {k: getattr(s, k) for k in _KEYS}
        prev = self.last_logged or dict.fromkeys(_KEYS, 0)
        self.last_logged = now
        w = {k: now[k] - prev[k] for k in _KEYS}
        if w["steps"] == 0:
            return  # idle since the last line
        req_steps = max(w["request_steps"], 1)
        d = controller.last_decision
        speedup = d.predicted_speedup if d is not None else float("nan")
        logger.info(
            "vllm-specplug: mean K_step %.2f, mean k/request %.2f, fallback %.0f%% of "
            "request-steps, acceptance %.2f, predicted speedup %.2fx, probes %d (%d ok), "
            "plain probes %d, requests %d (%d in fallback)",
            w["sum_k_step"] / w["steps"], w["granted_slots"] / req_steps,
            100.0 * w["fallback_request_steps"] / req_steps,
            w["accepted"] / max(w["drafted"], 1), speedup, w["probes_sent"],
            w["probes_succeeded"], w["plain_probes"], controller.num_requests(),
            controller.num_in_fallback())
