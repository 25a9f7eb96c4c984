"""vllm-specplug: adaptive-K speculative decoding for vLLM.

Select the scheduler with ``--scheduler-cls vllm_specplug.AdaptiveSpecScheduler``.
Importing this package is cheap: the vLLM adapter is imported on first use.
"""

from vllm_specplug.version import __version__

__all__ = ["AdaptiveSpecScheduler", "__version__"]


def __getattr__(name):
    if name == "AdaptiveSpecScheduler":
        from vllm_specplug.scheduler import AdaptiveSpecScheduler

        return AdaptiveSpecScheduler
    raise AttributeError(f"module 'vllm_specplug' has no attribute {name!r}")
