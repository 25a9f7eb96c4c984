"""Switching one running engine between policies, for benchmarks (between runs only).

The A/B benchmarks compare policies on one engine (one engine start,
policies interleaved).  Nothing here runs in a served engine: the runtime
imports nothing from ``tools``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vllm_specplug.config import SpecPlugConfig
from vllm_specplug.zero_cost import ZeroCostBook


def reconfigure(sp, overrides: dict[str, Any], pin_k_step: bool | None = None) -> None:
    """Rebuild the controller of ``sp`` (an ``AdaptiveSpecState``) from the
    start-up config with ``overrides``.

    The result is validated like the start-up config and the controller
    starts fresh, as on a new server.  ``pin_k_step=True`` leaves K_step to
    vLLM (its batch-size table, or ``num_speculative_tokens``) and has the
    policy pick per-request K under it.  Only between runs: no request may
    be in flight.
    """
    if not sp.enabled:
        raise RuntimeError(f"vllm-specplug is inert here: {sp.reason}")
    if sp.controller.num_requests():
        raise RuntimeError("reconfigure() needs an idle engine: requests are in flight")
    # Relative to the start-up config, so successive calls do not stack.
    raw = {f.name: getattr(sp.startup_config, f.name) for f in fields(SpecPlugConfig)}
    raw.update(overrides)
    config = SpecPlugConfig.from_dict(raw, sp.num_spec_tokens)
    vllm_config = sp.vllm_config
    sp.config = config
    sp.deployment = sp.deployment.with_config(vllm_config, config)
    sp.ceiling = config.ceiling(sp.num_spec_tokens)
    if pin_k_step is not None:
        sp.k_step_pinned = pin_k_step
        sp.pin_reason = "reconfigured"
    if sp.metrics is not None:
        sp.metrics.flush(sp.controller, sp.faults)
    sp.zero_cost = ZeroCostBook(sp.deployment.zero_cost, sp.block_size)
    sp.profile = sp._profile()
    sp.controller = sp._new_controller()
    if sp.metrics is not None:
        sp.metrics.controller_replaced(sp.controller)
    sp.planned = {}
    sp._confidence_state()
    sp.sched_end.clear()
    sp.predicted.clear()
    sp.last_update_end = None
    if sp.trace is not None:
        sp.trace.close()
    sp.trace = sp._open_trace(vllm_config)


def set_zero_cost(proposer, on: bool) -> bool:
    """Switch the zero-cost fallback's skipping on or off for one draft proposer
    (``patches/draft_model_skip.py``; benchmarks compare both).

    Only between runs, with no request in flight and the prefix cache reset:
    the stale-block marks start empty, which is right only if no block the
    marks described can be read again (freed blocks are rewritten before
    they are read; the reset drops cached ones).  Returns whether skipping
    is now on (it stays off where ``install``/the config check refused it).
    """
    from vllm_specplug.patches import draft_model_skip

    state = draft_model_skip.reset(proposer)
    if not on and state:
        # The state a worker that gave up is left in (``_give_up``): vLLM's
        # first pass at K=0, and the step's output says so.
        proposer.__dict__["_specplug_skip"] = False
        return False
    return bool(state)
