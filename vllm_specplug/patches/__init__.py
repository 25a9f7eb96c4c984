"""Patches to vLLM, one file each; each says why, what, and when it can go.

``install_all()`` runs from the plugin entry point in every vLLM process.
Every patch installs through ``install_once``: once per process, never on
top of itself, all of its wrappers or none, and a patch whose target code
has changed leaves vLLM untouched with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.specplug")

# Per patch name, why it is off (None: installed), for this process.
_RESULTS: dict[str, str | None] = {}


def install_once(name: str, owner: Callable[[], Any],
                 wrappers: dict[str, Callable[[Callable], Callable]], consequence: str,
                 check: Callable[[Any], str | None] | None = None) -> str | None:
    """Wrap attributes of vLLM's ``owner()`` (a class or module) once per process.

    ``wrappers`` maps each attribute to a function that takes vLLM's original
    and returns its wrapper; ``check(owner)`` names what the patch needs and
    the owner lacks.  Returns why the patch is off, or None when installed.
    A reason is logged once, as ``"vllm-specplug: <reason>; <consequence>"``.
    """
    if name in _RESULTS:
        return _RESULTS[name]
    why = None
    try:
        target = owner()
    except ModuleNotFoundError as exc:
        # The code this patch wraps is not in this vLLM (0.34 removed V1's
        # proposers with the V1 runner): nothing there to patch.
        return not_needed(name, f"{exc.name} is not in this vLLM")
    try:
        missing = [attr for attr in wrappers if getattr(target, attr, None) is None]
        if missing:
            why = f"{getattr(target, '__name__', target)} has no {', '.join(missing)}"
        elif check is not None:
            why = check(target)
        if why is None:
            for attr, wrap in wrappers.items():
                original = getattr(target, attr)
                if getattr(original, "_specplug_patch", None) == name:
                    continue  # already ours (a module imported twice)
                wrapper = wrap(original)
                wrapper.__wrapped__ = original
                wrapper._specplug_patch = name
                setattr(target, attr, wrapper)
    except Exception as exc:  # noqa: BLE001 - a changed vLLM: leave it alone
        why = f"cannot patch vLLM for {name} ({type(exc).__name__}: {exc})"
    if why:
        logger.warning("vllm-specplug: %s; %s", why, consequence)
    _RESULTS[name] = why
    return why


def not_needed(name: str, why: str) -> str:
    """Record, and say once at INFO, that this vLLM needs no patch ``name``."""
    if name not in _RESULTS:
        logger.info("vllm-specplug: patch %s not needed: %s", name, why)
        _RESULTS[name] = why
    return _RESULTS[name]


def install_all() -> dict[str, str | None]:
    """Install every patch; maps patch name to why it is off (None: installed)."""
    from vllm_specplug.patches import (draft_confidence, draft_model_skip, kernel_override_scan,
                                      ngram_threads, request_args_check, startup_profile)

    # The confidence stop first: its ``propose`` wrapper must sit inside the
    # zero-cost one, which clears the draft's stale marks after vLLM's returns.
    return {draft_confidence.PATCH_NAME: draft_confidence.install(),
            draft_model_skip.PATCH_NAME: draft_model_skip.install(),
            kernel_override_scan.PATCH_NAME: kernel_override_scan.install(),
            ngram_threads.PATCH_NAME: ngram_threads.install(),
            request_args_check.PATCH_NAME: request_args_check.install(),
            startup_profile.PATCH_NAME: startup_profile.install()}
