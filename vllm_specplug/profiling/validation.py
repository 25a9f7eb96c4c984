"""The check of a cached table: two fresh shapes timed against it.

Before a cached table is trusted two fresh shapes are timed against it
(one request: plain, and drafting K); if either is more than
``VALIDATE_TOLERANCE`` off, the table is measured again.
"""

from __future__ import annotations

import statistics
import time

from vllm_specplug.controller.profile import StepProfile
from vllm_specplug.profiling import testbench
from vllm_specplug.profiling.rounds import lead_in

# Timed repeats of one shape where a shape is timed on its own (validate).
# Source: ea72ce0 (two samples priced K=1 5x off); validate_check.py at fdfee3c:
# any warm-up 0-2 / repeats 1-5 and a 0.25 tolerance keep all 4 starts' tables.
REPEATS = 3
WARMUP = 1
VALIDATE_TOLERANCE = 0.25


def robust_median(times: list[float]) -> float:
    """The median of the samples within 1.5x of the fastest.

    Interference (another process on the cores, a page fault, a GC pause)
    only ever makes a step slower, and on a busy machine it hits a large
    share of millisecond steps: those samples are left out."""
    fastest = min(times)
    return statistics.median([t for t in times if t <= 1.5 * fastest])


def shape(bench, k_step: int, drafts: int) -> tuple[float, int]:
    """Median seconds and tokens of one shape, after WARMUP discarded steps."""
    times, tokens = [], 0
    for _ in range(WARMUP):
        bench.step(k_step, drafts)
    while len(times) < REPEATS:
        seconds, tokens, _ = bench.step(k_step, drafts)
        times.append(seconds)
    return robust_median(times), tokens


def validate_steps(bench, k: int) -> tuple[float, int, float, int]:
    """Two fresh shapes on ``bench``: one request plain, and drafting K."""
    bench.add(1)
    plain, t_plain = shape(bench, 0, 0)
    lead_in(bench, k)  # proposes K (and catches the draft up)
    wide, t_wide = shape(bench, k, k)
    return plain, t_plain, wide, t_wide


def validate(executor, vllm_config, kv_cache_config, profile: StepProfile, k: int,
             zero_cost: bool = False, reset_workers=None) -> tuple[bool, str, tuple]:
    """Time two fresh shapes (one request: plain, and drafting K) against a cached table:
    whether it is kept, why, and the two ratios measured / cached."""
    bench = testbench._Bench(executor, vllm_config, kv_cache_config,
                             time.monotonic() + testbench.DEADLINE_S)
    try:
        plain, t_plain, wide, t_wide = validate_steps(bench, k)
    finally:
        bench.close()
        if zero_cost and reset_workers is not None:
            reset_workers()
    want_plain = profile.step(t_plain, 1, 0)
    want_wide = profile.step(t_wide, 1, k)
    ratios = (plain / want_plain, wide / want_wide)
    ok = all(1 - VALIDATE_TOLERANCE <= r <= 1 + VALIDATE_TOLERANCE for r in ratios)
    return ok, f"measured/cached {ratios[0]:.2f} (plain), {ratios[1]:.2f} (K={k})", ratios
