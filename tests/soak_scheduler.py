"""A scheduler for the soak test: the plugin's, with its controller failing on purpose.

Every ``SPECPLUG_SOAK_FAULT_EVERY``-th per-step call into the controller
(planning, learning from a verification, timing a step) raises.  The adapter's fail-safe
must absorb each one: that step runs with vLLM's own K and exact output.
Named by ``scheduler-cls: soak_scheduler.FaultInjectingScheduler`` with this
folder on ``PYTHONPATH``.
"""

import functools
import os

from vllm_specplug import AdaptiveSpecScheduler

CALLS = ("plan", "observe_verifications", "observe_step")


class InjectedFault(RuntimeError):
    pass


def inject_faults(ctrl, every: int) -> list[int]:
    """Make every ``every``-th call of ``CALLS`` on ``ctrl`` raise; returns the call count."""
    count = [0]
    for name in CALLS:
        original = getattr(ctrl, name)

        @functools.wraps(original)
        def faulty(*a, __original=original, **kw):
            count[0] += 1
            if count[0] % every == 0:
                raise InjectedFault(f"injected fault #{count[0] // every}")
            return __original(*a, **kw)

        setattr(ctrl, name, faulty)
    return count


class FaultInjectingScheduler(AdaptiveSpecScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        every = int(os.environ.get("SPECPLUG_SOAK_FAULT_EVERY", "0"))
        if every and self.specplug.controller is not None:
            inject_faults(self.specplug.controller, every)
