"""Profiles and drivers the controller's unit tests share (no vLLM, no wall clock).

Every verdict is taken against a fixed step-cost profile (``StepProfile``):
the simulated steps take the profile's own price (with lognormal noise, or a
warm-up slowdown where a test says so), and those times reach the controller
only through ``observe_step``, as the scheduler's would.
"""

import numpy as np

from vllm_specplug.controller import StepProfile

# -- profiles ------------------------------------------------------------------

# Memory-bound (a GPU's small steps): a step costs about the same for 1 or
# 256 tokens, and a draft pass a twentieth of a plain step.
GPU_LIKE = StepProfile(
    tokens=[1, 256, 1024, 4096], target_s=[10e-3, 11e-3, 25e-3, 90e-3],
    first_s=[0.5e-3, 0.6e-3, 1.5e-3, 5e-3], batch=[1, 64, 256],
    pass_s=[0.5e-3, 0.6e-3, 1.2e-3], meta={"source": "test", "platform": "cuda"})

# Between the two (a GPU at a moderate batch, a draft a fifth of the
# target's step): a verified token costs 3% of a plain step of one request,
# a draft pass 20%.  Good drafts pay, bad ones do not.
MODERATE = StepProfile(
    tokens=[1, 4096], target_s=[10e-3, 10e-3 + 0.3e-3 * 4095], first_s=[2e-3, 2e-3],
    batch=[1, 256], pass_s=[2e-3, 3e-3], meta={"source": "test", "platform": "cuda"})

# Compute-bound (a CPU): every token verified costs as much as a plain step of
# one request, so no draft, however good, can pay for its verification.
CPU_BOUND = StepProfile(
    tokens=[1, 4096], target_s=[2e-3, 2e-3 * 4096], first_s=[0.2e-3, 0.2e-3 * 4096],
    batch=[1, 256], pass_s=[0.2e-3, 0.2e-3 * 256], meta={"source": "test", "platform": "cpu"})


# The Qwen pair's start-up profile on this CPU, rounded (zero-cost fallback).
QWEN_CPU = StepProfile.from_dict({
    "tokens": [1, 2, 4, 9, 18, 36], "target_s": [0.13, 0.14, 0.115, 0.14, 0.2, 0.36],
    "first_s": [0.05, 0.04, 0.045, 0.053, 0.09, 0.12], "batch": [1, 2, 4],
    "pass_s": [0.042, 0.045, 0.045], "catchup_tokens": [62, 144, 296],
    "catchup_s": [0.15, 0.32, 0.63], "meta": {"zero_cost_fallback": True}})


def tiny_serve_profile() -> StepProfile:
    """The tiny models behind vllm serve (test_server) on a CPU, as fitted there.

    The target as its own draft with zero-cost fallback: a plain step 2.5 ms +
    0.16 ms a token, a draft pass 0.75 ms, a catch-up 0.75 ms + 0.05 ms a
    skipped token.  At one request, perfect drafts at K=4 run at about twice
    the plain rate: drafting pays.
    """
    t = np.array([1.0, 2, 4, 8, 16, 32, 64])
    c = np.array([1.0, 16, 64, 256, 1024])
    return StepProfile(t, 2.5e-3 + 1.6e-4 * t, np.full(t.size, 7.5e-4), [1, 4, 16],
                       [7.5e-4, 8e-4, 1e-3], catchup_tokens=c, catchup_s=7.5e-4 + 5e-5 * c,
                       meta={"source": "test", "platform": "cpu"})


# -- drivers -------------------------------------------------------------------

def simulate_verification(rng, alpha, drafted):
    accepted = 0
    while accepted < drafted and rng.random() < alpha:
        accepted += 1
    return accepted


def drive(ctrl, alphas, steps, rng, noise=0.1, prefix="r", fixed_k_step=None):
    """Run ``steps`` steps for requests with the given true acceptance rates.

    Keeps vLLM's pipeline: the drafts planned at step t are proposed at the
    end of step t and verified in step t+1, so the controller sees their
    outcome only after it has planned step t+1.  A step takes the profile's
    price of what it ran, with ``noise`` (lognormal sigma).
    """
    ids = [f"{prefix}{i}" for i in range(len(alphas))]
    for r in ids:
        ctrl.add_request(r)
    history = []
    previous = np.zeros(len(ids), dtype=np.int64)
    for _ in range(steps):
        d = ctrl.plan(ids, fixed_k_step=fixed_k_step)
        tokens = len(ids) + int(previous.sum())
        ctrl.observe_verifications(
            ids, previous, [simulate_verification(rng, a, k) for a, k in zip(alphas, previous)])
        seconds = ctrl.profile.step(tokens, len(ids), d.k_step) * rng.lognormal(0.0, noise)
        ctrl.observe_step(len(ids), tokens, d.k_step, seconds)
        history.append(d)
        previous = d.k.copy()
    return ids, history


def drive_perfect_drafts(ctrl, batch, steps, rng, warm_up=None, zero_cost_fallback=True):
    """Run ``steps`` steps of ``batch`` requests whose drafts are always accepted.

    Returns the k granted to the first request, step by step.  A step takes
    the profile's price with 10% lognormal noise; the first drafting steps
    are multiplied by the factors in ``warm_up`` (a draft's first steps run
    new shapes), a list taken from as they run.
    With ``zero_cost_fallback`` the draft skips K_step = 0 steps and catches
    up on their tokens in the next step that drafts.
    """
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        ctrl.add_request(r)
    previous, gap, granted = np.zeros(batch, dtype=np.int64), 0, []
    for _ in range(steps):
        d = ctrl.plan(ids, catchup_tokens=gap)
        ctrl.observe_verifications(ids, previous, previous)
        tokens = batch + int(previous.sum())
        catchup = gap if d.k_step else 0
        seconds = ctrl.profile.step(tokens, batch, d.k_step, catchup)
        if d.k_step and warm_up:
            seconds *= warm_up.pop(0)
        ctrl.observe_step(batch, tokens, d.k_step, seconds * rng.lognormal(0.0, 0.1), catchup)
        if zero_cost_fallback:
            gap = 0 if d.k_step else gap + tokens
        previous = d.k.copy()
        granted.append(int(d.k[0]))
    return granted


def random_profile(rng, max_tokens=2048, max_batch=128):
    """A profile with random sizes and prices (not necessarily monotone)."""
    n_t, n_b = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    tokens = np.unique(rng.integers(1, max_tokens, size=n_t)).astype(float)
    batch = np.unique(rng.integers(1, max_batch, size=n_b)).astype(float)
    target = rng.uniform(0.5, 2.0) * (1.0 + np.cumsum(rng.uniform(0.0, 0.3, tokens.size)))
    if rng.random() < 0.3:
        target = rng.uniform(0.5, 5.0, tokens.size)  # any positive prices
    first = rng.uniform(0.0, 0.5, tokens.size) * (rng.random() < 0.8)
    passes = rng.uniform(0.0, 0.5, batch.size)
    kw = {}
    if rng.random() < 0.5:
        kw["pad_sizes"] = np.unique(rng.integers(1, max_tokens, size=int(rng.integers(1, 12))))
    if rng.random() < 0.5:
        c = np.unique(rng.integers(1, 4 * max_tokens, size=int(rng.integers(1, 4))))
        kw["catchup_tokens"], kw["catchup_s"] = c, rng.uniform(0.0, 3.0, c.size)
    # A profile with a catch-up is a zero-cost one: a plain step skips `first`.
    return StepProfile(tokens, target, first, batch, passes,
                       meta={"zero_cost_fallback": "catchup_tokens" in kw}, **kw)


def drive_true_prices(ctrl, alpha, batch, steps, plain_factor, rng):
    """``batch`` requests of acceptance ``alpha``; a step takes the profile's
    price, a plain step ``plain_factor`` times it, with the zero-cost
    fallback's catch-up.  Returns the K_step of every step."""
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        ctrl.add_request(r)
    previous, gap, k_steps = np.zeros(batch, dtype=np.int64), 0, []
    for _ in range(steps):
        d = ctrl.plan(ids, catchup_tokens=gap, catchup_if_plain=gap + batch)
        ctrl.observe_verifications(
            ids, previous, [simulate_verification(rng, alpha, k) for k in previous])
        tokens = batch + int(previous.sum())
        catchup = gap if d.k_step else 0
        seconds = ctrl.profile.step(tokens, batch, d.k_step, catchup)
        if d.k_step == 0:
            seconds *= plain_factor
        ctrl.observe_step(batch, tokens, d.k_step, seconds * rng.lognormal(0.0, 0.05), catchup)
        gap = 0 if d.k_step else gap + batch
        previous = d.k.copy()
        k_steps.append(d.k_step)
    return np.array(k_steps)


def qwen_cpu_profile() -> StepProfile:
    """Qwen2.5-Coder 1.5B with its 0.5B draft on this 2-vCPU machine, zero-cost
    fallback: the profile the served benchmark measured (seconds).  The
    draft's first pass over a 150-token prompt costs about a third of a
    second, twice a plain step."""
    return StepProfile([1, 2, 4, 9, 18, 36], [0.157, 0.168, 0.168, 0.168, 0.278, 0.345],
                       [0.054, 0.063, 0.063, 0.063, 0.063, 0.103], [1, 2, 4],
                       [0.052, 0.057, 0.057], catchup_tokens=[57, 137, 309],
                       catchup_s=[0.134, 0.302, 0.611],
                       meta={"source": "test", "platform": "cpu", "zero_cost_fallback": True})
