"""The measurement rounds, shared by the start-up profile and the simulator.

Per batch size B (1, 2, 4, ... up to ``max_num_seqs``, within a time
budget) and the ceiling K, rounds of six steps (K_step, drafts verified):

    (0, K)   target(B (1 + K))
    (0, 0)   target(B)
    (1, 0)   target(B) + first(B), and the catch-up of the two plain steps
    (1, 0)   target(B) + first(B)
    (K, 0)   target(B) + first(B) + (K - 1) pass(B)
    (K, K)   target(B (1 + K)) + first(B (1 + K)) + (K - 1) pass(B)

so that no step verifies more drafts than the step before it proposed
(the last step of a round proposes K for the first of the next; a lead-in
step at K_step = K precedes a round wherever that is not so).  vLLM's GPU
runners gather a step's drafts from what the previous step proposed: more
would read past them (``test_profile_sequence_*`` checks every sequence
this package runs).  The rounds are timed ``ROUNDS`` or more times after
one discarded warm-up round.  Interference on a shared host
(another process on the cores, a page fault, a GC pause) comes and goes
over seconds: timed in rounds it lands on every shape alike instead of on
whichever shape happened to be measured then, and the first-pass and
draft-pass costs are differences of steps of the same round.  Each price
is the median over rounds.  The draft-pass and catch-up curves are then
made non-decreasing in their size (an isotonic fit, ``StepProfile.monotone``):
where the medians say a pass over more requests costs less, the fit averages
the two.  The token curves stay as measured (their points come from
different batch sizes, and a smaller shape can be truly slower); each plan
reads them non-decreasing from its own step's size up
(``GoodputPolicy.prices``), so no dip is left for the argmax to chase.  The
raw medians stay in ``meta["raw"]``.

With the zero-cost fallback the first K_step = 1 step of each round
follows two K_step = 0 steps and so also catches the draft up: the worker
repairs whole KV blocks, from the start of the first block the skipped
steps left stale to each request's computed length.  Timed against the
round's K_step = 1 step, that is the catch-up curve, indexed by those
tokens (``deployment.catch_up_tokens``, which the scheduler counts alike).

``run_rounds`` takes any bench with ``add(n)``, ``step(k_step, drafts)``
and ``size``: the engine's (``testbench._Bench``) or the simulator's.
"""

from __future__ import annotations

import logging
import statistics

from vllm_specplug.controller.profile import StepProfile

logger = logging.getLogger("vllm.specplug")

# Rounds per batch size (one step of each shape a round): at least ROUNDS,
# more (up to MAX_ROUNDS) while a batch size's rounds take under ROUNDS_S,
# so that millisecond steps get a robust median.
# Source: constants_sweep.py at d7f86db: 2 rounds -0.0061, no extra rounds -0.0054.
ROUNDS = 4
MAX_ROUNDS = 9
ROUNDS_S = 1.5
# Untimed rounds at batch 1 before any is timed (the process's first steps),
# and discarded rounds at each batch size (its shapes' first steps).
# Source: constants_sweep.py at d7f86db: without either, -0.0040 and -0.0042.
LEAD_ROUNDS = 2
SIZE_WARMUP_ROUNDS = 1
# Seconds the measurement may take before it stops adding larger batches.
# Source: constants_sweep.py at d7f86db: 10 s -0.0100, 300 s -0.0007.
BUDGET_S = 75.0


def lead_in(bench, k: int) -> None:
    """A step at K_step = ``k`` where the previous step proposed fewer drafts."""
    if bench.proposed < k:
        bench.step(k, 0)


def _round(bench, k: int) -> dict[str, float]:
    """One step of each shape at the bench's batch: seconds, and the sizes they ran.

    Each step verifies at most what the one before it proposed; the round
    ends having proposed ``k``, ready for the next."""
    lead_in(bench, k)
    a_wide, t_wide, _ = bench.step(0, k)
    a_plain, t_plain, _ = bench.step(0, 0)
    # The first drafting step after those catches the draft up.
    c_secs, _, c_tokens = bench.step(1, 0)
    f_plain, _, _ = bench.step(1, 0)
    e_plain = bench.step(k, 0)[0] if k > 1 else f_plain
    e_wide, _, _ = bench.step(k, k)
    return {"a_wide": a_wide, "a_plain": a_plain, "catchup": max(c_secs - f_plain, 0.0),
            "first_plain": f_plain - a_plain,
            # (K, K) less (0, K) is first(B (1 + K)) + (K - 1) pass(B).
            "first_wide": (e_wide - a_wide) - (e_plain - f_plain),
            "pass": (e_plain - f_plain) / max(k - 1, 1),
            "t_wide": t_wide, "t_plain": t_plain, "c_tokens": c_tokens}


def run_rounds(bench, k: int, max_batch: int, token_budget: int, zero_cost: bool, clock,
               budget_s: float = BUDGET_S, log: bool = False) -> StepProfile:
    """The measurement on ``bench`` (``add(n)``, ``step(k_step, drafts)``, ``size``).

    ``clock()`` reads seconds (the simulator's bench keeps its own).  Returns
    the fitted profile; ``meta`` has the raw medians, the shapes timed, the
    median spread of a round's plain step around its median, and the seconds.
    """
    started = clock()
    # The process's first steps are slow beyond any one round's warm-up
    # (allocator, kernels picked on first use): a few untimed steps of each
    # kind first.
    bench.add(1)
    for _ in range(LEAD_ROUNDS):
        _round(bench, k)
    target: dict[int, list[float]] = {}
    first: dict[int, list[float]] = {}
    passes: dict[int, float] = {}
    catchups: dict[int, float] = {}
    spreads: list[float] = []
    shapes = 0
    med = statistics.median
    b = 1
    while b <= max_batch and b * (1 + k) <= token_budget:
        before = clock()
        bench.add(b - bench.size)
        for _ in range(SIZE_WARMUP_ROUNDS):  # this batch size's shapes run for the first time
            _round(bench, k)
        rounds: list[dict[str, float]] = []
        while len(rounds) < ROUNDS or (len(rounds) < MAX_ROUNDS and clock() - before < ROUNDS_S):
            rounds.append(_round(bench, k))
        shapes += 6
        col = {key: [r[key] for r in rounds] for key in rounds[0]}
        a_plain, a_wide = med(col["a_plain"]), med(col["a_wide"])
        t_plain, t_wide = int(col["t_plain"][0]), int(col["t_wide"][0])
        target.setdefault(t_plain, []).append(a_plain)
        target.setdefault(t_wide, []).append(a_wide)
        first.setdefault(t_plain, []).append(max(med(col["first_plain"]), 0.0))
        first.setdefault(t_wide, []).append(max(med(col["first_wide"]), 0.0))
        passes[b] = max(med(col["pass"]), 0.0)
        if zero_cost and col["c_tokens"][0]:
            catchups[int(med(col["c_tokens"]))] = med(col["catchup"])
        spreads.append(med(abs(x - a_plain) for x in col["a_plain"]) / a_plain)
        if log:
            logger.info("vllm-specplug: profiling B=%d: step %.1f ms plain, %.1f ms with %d "
                        "drafts each, drafting adds %.1f ms (%d rounds, %.0f s so far)", b,
                        a_plain * 1e3, a_wide * 1e3, k, med(col["first_wide"]) * 1e3,
                        len(rounds), clock() - started)
        # The next batch size takes about twice as long as this one did.
        if clock() - started + 2.0 * (clock() - before) > budget_s:
            break
        b = b * 2 if b * 2 <= max_batch or b == max_batch else max_batch
    tokens = sorted(target)
    raw = StepProfile(
        tokens, [med(target[t]) for t in tokens], [med(first[t]) for t in tokens],
        sorted(passes), [passes[x] for x in sorted(passes)],
        catchup_tokens=sorted(catchups) or None,
        catchup_s=[catchups[c] for c in sorted(catchups)] or None)
    profile = raw.monotone()
    profile.meta = {"zero_cost_fallback": bool(zero_cost), "seconds": round(clock() - started, 3),
                    "shapes": shapes, "rounds_min": ROUNDS,
                    "fit": "isotonic (draft pass, catch-up)",
                    "spread": round(med(spreads), 4) if spreads else None,
                    "raw": {key: val for key, val in raw.to_dict().items() if key != "meta"}}
    return profile
