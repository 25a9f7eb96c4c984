"""Test harness: another vLLM's scheduler, from its wheel's Python, with no engine.

``make test`` unpacks the Python files of the ``vllm==0.33.0`` and
``vllm==0.34.0`` wheels (no compiled parts) and runs the scheduler-level suite
with each first on ``PYTHONPATH``, ``SPECPLUG_SUITE=side`` and
``SPECPLUG_SIDE_VLLM`` naming the version (tests/conftest.py calls
``install``).  On this CPU machine two things stand in the way, and the harness
moves both, for the tests only:

- vLLM's platform detection: ``VLLM_TARGET_DEVICE=cpu`` picks the CPU platform;
- the CPU platform's check that x86 has triton-cpu (``CpuPlatform.check_and_update_config``
  raises "vLLM on x86 CPUs requires Triton"): ``HAS_TRITON`` reads true while
  that check runs.  No kernel runs in these tests.

vLLM 0.33 still has the V1 runner and picks V2 only with Triton (its GPU
default); the harness sets ``VLLM_USE_V2_MODEL_RUNNER=1`` for it, as a GPU
machine's config would resolve.  The CPU platform turns async scheduling off;
the suite builds ``AsyncScheduler`` itself where it needs it, as the engine
core of a GPU deployment would.
"""

import os

EXPECTED = os.environ.get("SPECPLUG_SIDE_VLLM", "0.34.0")


def install() -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if EXPECTED.startswith("0.33."):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    import vllm

    if vllm.__version__ != EXPECTED:
        raise RuntimeError(f"the side suite expects vLLM {EXPECTED} first on PYTHONPATH, "
                           f"found {vllm.__version__} at {vllm.__file__}")
    import vllm.triton_utils as triton_utils
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__

    def check_without_triton_gate(cls, vllm_config):
        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    cpu.CpuPlatform.check_and_update_config = classmethod(check_without_triton_gate)
