"""Running a simulator cell: ``run_cell(CellSpec)`` is a pure function of its
spec (same spec, same result dict, in any process, so a sweep can be mapped
in parallel); ``record_trace`` also returns the acceptance trace it saw."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from vllm_specplug.tools.sim.cell import CellSpec, setup_for
from vllm_specplug.tools.sim.engine import Engine
from vllm_specplug.tools.sim.trace import Trace


def _result(spec: CellSpec, engine: Engine) -> dict:
    m = engine.m
    ctrl = engine.policy.controller
    out = {
        "key": spec.key(),
        **{k: v for k, v in asdict(spec).items()},
        "goodput": engine.window[1] / engine.window[0] if engine.window[0] > 0 else 0.0,
        "window_seconds": engine.window[0],
        "window_completions": engine.window[2],
        "mean_latency_s": float(np.mean(engine.latencies)) if engine.latencies else None,
        "steps_measured": m.steps,
        "seconds": m.seconds,
        "tokens": m.tokens,
        "mean_k_step": m.sum_k_step / max(m.steps, 1),
        "mean_k": m.drafted / max(m.decode_request_steps, 1),
        "acceptance": m.accepted / m.drafted if m.drafted else None,
        "fallback_frac": (m.fallback_request_steps / max(m.planned_request_steps, 1)
                          if engine.policy.speculative else None),
        "finished": m.finished,
        "mean_decode_batch": m.decode_request_steps / max(m.steps, 1),
        "prefill_share": m.prefill_tokens / max(
            m.prefill_tokens + m.decode_request_steps + m.drafted, 1),
    }
    if ctrl is not None:
        st = ctrl.stats
        corr = ctrl.pricer.correction
        out["controller"] = {
            "probes_sent": st.probes_sent, "probes_succeeded": st.probes_succeeded,
            "recoveries": st.recoveries,
            "invariant_violations": engine.policy.violations,
            # The profile's correction: its common level ("common") and the
            # step shapes the steps used, "<tokens>x<requests>" (each band's
            # first value) -> ratio of measured to profiled time.
            "correction": corr.learnt(),
        }
    out["clock"] = {"cold_steps": engine.timer.cold_steps_run, "stalls": engine.timer.stalls}
    return out


def run_cell(spec: CellSpec) -> dict:
    """One (setup, scenario, policy, concurrency, seed) cell -> result dict."""
    engine = Engine(spec, setup_for(spec))
    engine.run()
    return _result(spec, engine)


def record_trace(spec: CellSpec) -> tuple[dict, Trace]:
    """Run a cell and return its result and the acceptance trace it saw."""
    engine = Engine(spec, setup_for(spec), record=True)
    engine.run()
    header = {"version": 1, "source": f"vllm_specplug.tools.sim {spec.key()}",
              "max_k": engine.setup.max_k}
    return _result(spec, engine), Trace(list(engine.trace_requests.values()), header)


__all__ = ["run_cell", "record_trace"]
