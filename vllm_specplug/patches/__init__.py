"""Patches to vLLM, one file each; each says why, what, and when it can go.

``install_all()`` runs from the plugin entry point in every vLLM process.
A patch whose target code has changed disables itself with one warning.
"""

from __future__ import annotations


def install_all() -> dict[str, str | None]:
    """Install every patch; maps patch name to why it is off (None: installed)."""
    from vllm_specplug.patches import (draft_model_skip, kernel_override_scan, request_args_check,
                                      startup_profile)

    return {draft_model_skip.PATCH_NAME: draft_model_skip.install(),
            kernel_override_scan.PATCH_NAME: kernel_override_scan.install(),
            request_args_check.PATCH_NAME: request_args_check.install(),
            startup_profile.PATCH_NAME: startup_profile.install()}
