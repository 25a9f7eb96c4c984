"""Measure the step-cost profile on the engine itself, before it serves.

The policy prices every plan from a ``StepProfile`` (controller/profile.py).
This package measures one in the engine-core process, after vLLM has loaded
the models, allocated the KV cache and warmed up, and before the scheduler
exists (``patches/startup_profile.py`` calls ``profile_for_engine``), by
running the engine's own steps on dummy requests.

- ``startup``: ``profile_for_engine``, the start-up orchestration (a given
  file, a checked cache entry, or a fresh measurement), and ``measure``.
- ``rounds``: the measurement rounds and their fit (``run_rounds``), shared
  with the simulator (``tools/sim/profile.py``).
- ``testbench``: ``_Bench``, dummy requests on a throwaway vLLM scheduler,
  stepped through the executor, and its deadline.
- ``validation``: the two-shape check of a cached table.
- ``keys``: the cache folder and the key that names a table.
- ``handoff``: the profile's way to the scheduler, on the KV cache config
  the engine core builds it from (``attach`` / ``attached``).

Every name is importable from the package as before.  A constant read at
run time is read from the module that defines it (``rounds.ROUNDS``,
``validation.VALIDATE_TOLERANCE``, ``testbench.DEADLINE_S``, ...): patch it
there.
"""

from vllm_specplug.profiling.handoff import (DEPLOYMENT_ATTR, PROFILE_ATTR, attach, attached,
                                             attached_deployment)
from vllm_specplug.profiling.keys import (PROFILE_FORMAT, cache_dir, cache_path, cpu_model,
                                          deployment_key)
from vllm_specplug.profiling.rounds import (BUDGET_S, LEAD_ROUNDS, MAX_ROUNDS, ROUNDS, ROUNDS_S,
                                            SIZE_WARMUP_ROUNDS, lead_in, run_rounds)
from vllm_specplug.profiling.testbench import (DEADLINE_S, PROMPT_TOKENS, ProfileSequenceError,
                                               _Bench)
from vllm_specplug.profiling.validation import (REPEATS, VALIDATE_TOLERANCE, WARMUP,
                                                robust_median, shape, validate, validate_steps)
from vllm_specplug.profiling.startup import measure, measurement_blocked, profile_for_engine

__all__ = [
    "BUDGET_S", "DEADLINE_S", "DEPLOYMENT_ATTR", "LEAD_ROUNDS", "MAX_ROUNDS", "PROFILE_ATTR",
    "PROFILE_FORMAT", "PROMPT_TOKENS", "REPEATS", "ROUNDS", "ROUNDS_S", "SIZE_WARMUP_ROUNDS",
    "VALIDATE_TOLERANCE", "WARMUP", "ProfileSequenceError", "attach", "attached",
    "attached_deployment", "cache_dir", "cache_path", "cpu_model", "deployment_key", "lead_in",
    "measure", "measurement_blocked", "profile_for_engine", "robust_median", "run_rounds",
    "shape", "validate", "validate_steps", "_Bench",
]
