"""Start-up: the profile this engine's scheduler will use (``profile_for_engine``).

``patches/startup_profile.py`` calls ``profile_for_engine`` in the
engine-core process, after vLLM has loaded the models, allocated the KV
cache and warmed up, and before the scheduler exists.  It reads a given
profile file, or checks a cached table (``validation``) and measures one
where there is none or it disagrees (``measure``: ``rounds.run_rounds`` on
``testbench._Bench``), caches it (``keys``), and attaches it to the KV
cache config the scheduler is built from (``handoff``).  The throwaway
scheduler is never built where KV events or a KV / encoder-cache connector
are configured (``measurement_blocked``: a second publisher and connectors
would see the dummy requests): there the policy prices steps from
parameter counts.  After dummy steps under the zero-cost fallback the
workers' stale-block marks are reset, since no block the profile wrote can
be read again.
"""

from __future__ import annotations

import logging
import os
import time

from vllm_specplug.controller.profile import StepProfile
from vllm_specplug.profiling import rounds, testbench, validation
from vllm_specplug.profiling.handoff import attach
from vllm_specplug.profiling.keys import cache_path, deployment_key
from vllm_specplug.profiling.rounds import BUDGET_S, run_rounds

logger = logging.getLogger("vllm.specplug")


def measurement_blocked(vllm_config) -> str | None:
    """Why a throwaway scheduler must not run dummy requests on this engine, or None."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is not None and getattr(events, "enable_kv_cache_events", False):
        return "KV cache events are published (a KV-aware router would index dummy blocks)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector is configured (it would see the dummy requests)"
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        return "an encoder-cache connector is configured"
    return None


def measure(executor, vllm_config, kv_cache_config, k: int, zero_cost: bool,
            budget_s: float = BUDGET_S, reset_workers=None) -> StepProfile:
    bench = testbench._Bench(executor, vllm_config, kv_cache_config,
                             time.monotonic() + testbench.DEADLINE_S)
    try:
        profile = run_rounds(bench, k, max(1, int(vllm_config.scheduler_config.max_num_seqs)),
                             int(vllm_config.scheduler_config.max_num_batched_tokens), zero_cost,
                             time.monotonic, budget_s, log=True)
    finally:
        bench.close()
        if zero_cost and reset_workers is not None:
            reset_workers()
    profile.meta.update(source="measured", seconds=round(profile.meta["seconds"], 1),
                        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return profile


def profile_for_engine(executor, vllm_config, kv_cache_config,
                       reset_workers=None) -> StepProfile | None:
    """The profile this engine's scheduler will use, per ``additional_config["specplug"].profile``.

    ``reset_workers()``, when given, runs after dummy steps under the
    zero-cost fallback: the workers forget the draft's stale-block marks
    (no block the dummy requests wrote can be read again).

    The profile is also attached to ``kv_cache_config`` (``attach``), which
    the engine core builds the scheduler from.  Returns None (the scheduler
    then prices from parameter counts) where nothing is measured:
    ``profile: off``, a policy that prices nothing, a method whose K_step is
    pinned, or an engine with KV events or connectors
    (``measurement_blocked``).  A path that cannot be read stops start-up
    with a message naming the key.
    """
    from vllm_specplug.config import SpecPlugConfigError
    from vllm_specplug.deployment import Deployment, uses_plugin_scheduler

    spec = vllm_config.speculative_config
    if spec is None or not uses_plugin_scheduler(vllm_config):
        return None
    dep = Deployment.settle(vllm_config)
    k, config = dep.num_spec_tokens, dep.config
    attach(kv_cache_config, None, dep)
    if k <= 0 or config.policy != "goodput" or config.profile == "off":
        return None
    if config.profile != "auto":
        try:
            profile = StepProfile.load(config.profile)
        except (OSError, ValueError, KeyError) as exc:
            raise SpecPlugConfigError(
                f'additional_config["specplug"].profile = {config.profile!r} cannot be read '
                f'as a step-cost profile ({exc}); allowed: "auto" | "off" | a path to a '
                f"profile JSON (vllm-specplug profile --config FILE writes one)") from exc
        logger.info("vllm-specplug: step-cost profile from %s", config.profile)
        attach(kv_cache_config, profile)
        return profile
    if dep.k_step_pinned:
        logger.info("vllm-specplug: K_step is pinned for this deployment (%s); no step-cost "
                    "profile is measured (prices from parameter counts and the live "
                    "correction)", dep.pin_reason)
        return None
    if dep.inert:
        return None  # the scheduler stays inert and says why
    blocked = measurement_blocked(vllm_config)
    if blocked:
        logger.info("vllm-specplug: no step-cost profile is measured: %s; prices from "
                    "parameter counts", blocked)
        return None
    zero_cost = dep.zero_cost
    key = deployment_key(vllm_config, zero_cost)
    path = cache_path(key)
    profile = None
    if os.path.exists(path) and not os.environ.get("VLLM_SPECPLUG_PROFILE_FRESH"):
        try:
            cached = StepProfile.load(path)
            ok, why, ratios = validation.validate(executor, vllm_config, kv_cache_config,
                                                  cached, k, zero_cost, reset_workers)
            if ok:
                profile = cached
                # What this start timed: the live correction starts from it.
                profile.meta["start_check"] = {"plain_batches": [1],
                                               "repeats": validation.REPEATS,
                                               "plain": ratios[0], "drafting": ratios[1]}
                logger.info("vllm-specplug: step-cost profile from the cache (%s; %s)", path, why)
            else:
                logger.info("vllm-specplug: cached step-cost profile disagrees with this "
                            "machine (%s); measuring again", why)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("vllm-specplug: cached profile %s unreadable (%s); measuring", path, exc)
    if profile is None:
        profile = measure(executor, vllm_config, kv_cache_config, k, zero_cost,
                          reset_workers=reset_workers)
        profile.meta["key"] = key
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            profile.save(tmp)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("vllm-specplug: could not cache the profile at %s: %s", path, exc)
        # Timed now, every batch size's plain step (not kept in the cache).
        profile.meta["start_check"] = {"plain_batches": [int(b) for b in profile.batch],
                                       "repeats": rounds.ROUNDS, "plain": 1.0, "drafting": 1.0}
        logger.info("vllm-specplug: step-cost profile measured in %.1f s over %d shapes "
                    "(batch 1-%d, %d token sizes); cached at %s", profile.meta["seconds"],
                    profile.meta["shapes"], int(profile.batch[-1]), profile.tokens.size, path)
    attach(kv_cache_config, profile)
    return profile
