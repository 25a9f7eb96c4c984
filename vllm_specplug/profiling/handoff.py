"""From the engine core's KV-cache set-up to the scheduler built after it.

The profile, and the ``Deployment`` settled for it, travel on the KV cache
config the engine core builds the scheduler from: one engine, one table.
"""

from __future__ import annotations

from vllm_specplug.controller.profile import StepProfile

# The attribute of the scheduler's KV cache config that carries the profile
# from the engine core's KV-cache set-up to the scheduler built from it.
PROFILE_ATTR = "specplug_step_profile"
DEPLOYMENT_ATTR = "specplug_deployment"


def attach(kv_cache_config, profile: StepProfile | None, deployment=None) -> None:
    """Hand ``profile``, and the ``Deployment`` settled for it, to the scheduler
    that will be built from ``kv_cache_config``."""
    setattr(kv_cache_config, PROFILE_ATTR, profile)
    if deployment is not None:
        setattr(kv_cache_config, DEPLOYMENT_ATTR, deployment)


def attached(kv_cache_config) -> StepProfile | None:
    """The profile measured for the engine whose scheduler has this KV cache config."""
    return getattr(kv_cache_config, PROFILE_ATTR, None)


def attached_deployment(kv_cache_config):
    """The ``deployment.Deployment`` the start-up profile settled for this engine, or None."""
    return getattr(kv_cache_config, DEPLOYMENT_ATTR, None)
