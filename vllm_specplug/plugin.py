"""vLLM general-plugin entry point (group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process it starts (front end, engine
core, each worker), possibly more than once.  It must be idempotent and
cheap: it imports nothing heavy and touches no device.  It checks the vLLM
version and the features the adapter relies on, and logs one line saying
what it enabled or why it stays inert.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.specplug")  # a child of vLLM's logger: same handlers and format

_STATE: dict[str, object] = {}


def register() -> None:
    if "registered" in _STATE:
        return
    _STATE["registered"] = True
    marker = os.environ.get("VLLM_SPECPLUG_REGISTER_LOG")
    if marker:
        # Tests use this to see which processes vLLM loaded the plugin in.
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
    import vllm_specplug.compat as compat

    version = compat.vllm_version()
    missing = compat.probe()
    _STATE["missing"] = missing
    _STATE["vllm_version"] = version
    pid = os.getpid()
    if missing:
        logger.warning(
            "vllm-specplug: vLLM %s lacks %s; the plugin stays inert and "
            "AdaptiveSpecScheduler behaves exactly like vLLM's scheduler (pid %d)",
            version, ", ".join(missing), pid)
        return
    if version not in compat.TESTED_VLLM:
        logger.warning(
            "vllm-specplug: vLLM %s is not a tested version (tested: %s); features "
            "probed ok, enabling", version, ", ".join(compat.TESTED_VLLM))
    from vllm_specplug.patches import install_all

    _STATE["patches"] = install_all()
    try:
        import vllm_specplug.metrics_bridge as metrics_bridge

        _STATE["metrics_bridge"] = metrics_bridge.register_collector()
    except Exception as exc:  # metrics must never stop vLLM from starting
        logger.warning("vllm-specplug: the /metrics bridge is off (%s)", exc)
    logger.info(
        "vllm-specplug: enabled for vLLM %s (pid %d); select it with "
        "--scheduler-cls vllm_specplug.AdaptiveSpecScheduler", version, pid)


def is_registered() -> bool:
    return bool(_STATE.get("registered"))


def missing_features() -> list[str]:
    if "missing" not in _STATE:
        import vllm_specplug.compat as compat

        _STATE["missing"] = compat.probe()
    return list(_STATE["missing"])  # type: ignore[arg-type]
