"""Per-request ``specplug_*`` knobs are validated in vLLM's front end.

vLLM runs the ``validate_params`` hook of every installed logits-processor
plugin (entry-point group ``vllm.logits_processors``) on each request at
admission, in the API process, and turns a ``ValueError`` into HTTP 400.
That is the supported place to reject a bad ``vllm_xargs`` value before it
reaches the engine, so a client error can never take the engine down.

The class is registered only for that hook.  With speculative decoding on,
vLLM does not instantiate installed logits-processor plugins at all; without
it, the instance is a no-op that returns the logits untouched.
"""

from __future__ import annotations

from vllm_specplug.config import MAX_REQUEST_K, SpecPlugRequestError, parse_request_args

try:  # vLLM is present wherever this entry point is loaded
    from vllm.v1.sample.logits_processor import LogitsProcessor
except Exception:  # pragma: no cover - lets the module import without vLLM
    LogitsProcessor = object  # type: ignore[misc,assignment]


class SpecPlugRequestValidator(LogitsProcessor):  # type: ignore[misc]
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = getattr(sampling_params, "extra_args", None)
        try:
            parse_request_args(extra, MAX_REQUEST_K)
        except SpecPlugRequestError as exc:
            raise ValueError(str(exc)) from None

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits
