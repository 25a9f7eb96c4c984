"""The goodput policy's single decision: the argmax against brute-force enumeration, the
min_gain margin, prefill and catch-up charges (milliseconds, no vLLM)."""

import itertools

import numpy as np
import pytest

from vllm_specplug.controller.profile import convex_rise
from vllm_specplug.controller import (
    ControllerSettings,
    GoodputPolicy,
    ProfileCorrection,
    SpecController,
    StepPricer,
    StepProfile,
    prior_profile,
)

from controller_cases import tiny_serve_profile, random_profile, qwen_cpu_profile


# -- the goodput policy: one decision --------------------------------------------------

def plan_seconds(pricer, batch, base, k_step, n, width):
    """Decode seconds of a plan as the policy defines them (its docstring).

    Plain decoding (K_step = 0): the plain step of the decoding requests, at
    the correction of a plain step of the step's size.  A plan that runs ``k_step`` draft
    positions and verifies ``n`` drafts: the step's corrected price, less the
    prefill chunk's share (profiled plain step with the chunk minus without
    it, and, when a plain step skips the draft, the draft's first pass with
    it minus without it, neither below zero) at the same correction, and
    never below a plan of the same step that verifies fewer drafts, and each
    further verified draft never cheaper than the one before it: the verify
    curve over base .. base + batch * width tokens, its steps fitted
    non-decreasing (pool adjacent violators) and floored at its start; with
    captured sizes only its running maximum.
    """
    profile, corr = pricer.profile, pricer.correction
    if k_step == 0:
        return corr.ratio(base, batch, 0) * profile.step(batch, batch, 0)
    tokens = base + n
    prefill = (max(profile.target(base) - profile.target(batch), 0.0)
               + draft_prefill_pass(profile, batch, base))
    from vllm_specplug.controller.profile import isotonic

    curve = [profile.target(base + m) + profile.first(base + m)
             for m in range(batch * width + 1)]
    if profile.pad_sizes is not None:
        fit = np.maximum.accumulate(curve)
    else:
        rise = np.concatenate([[0.0], np.cumsum(isotonic(np.diff(curve)))])
        fit = np.maximum(curve[0] + rise, curve[0])
    raw = fit[n] + (k_step - 1) * profile.draft_pass(batch) - prefill
    return corr.ratio(tokens, batch, k_step) * raw


def draft_prefill_pass(profile, batch, base):
    """The draft's pass over a prefill chunk that a plain step would skip."""
    if not profile.skips_draft_at_k0:
        return 0.0
    return max(profile.first(base) - profile.first(batch), 0.0)


def owed_per_token(pricer, batch, base, catch_up, horizon):
    """What a drafting plan is charged per token it yields: the catch-up and
    the draft's pass over the prefill chunk, spread over ``horizon`` tokens."""
    if horizon is None:
        return 0.0
    unseen = catch_up + pricer.correction.ratio(base, batch) * draft_prefill_pass(pricer.profile, batch,
                                                                           base)
    return unseen / max(horizon, 1.0)


def best_rate_by_enumeration(survival, ceilings, base, pricer, fixed_k_step=None,
                             catch_up=0.0, horizon=None, skip=0.0):
    """The best decode rate over every (K_step, top-n slots) plan.

    For a K_step j the slots a plan may admit are those of positions below j
    (and below each request's ceiling); the price depends on how many it
    admits, so of each number n the most likely n are best.  Slots below
    ``GoodputPolicy.MIN_SURVIVAL`` are never worth a token's verification.
    K_step runs up to one past the deepest such slot.
    Prices as ``plan_seconds`` plus ``owed_per_token`` for each token of a
    drafting plan, and plain decoding plus ``skip`` spread over ``horizon``
    for each of its tokens, one scalar lookup at a time.
    """
    batch, width = survival.shape
    owed = owed_per_token(pricer, batch, base, catch_up, horizon)
    plain_owed = skip / max(horizon, 1.0) if horizon is not None and fixed_k_step is None else 0.0
    # A K_step past the deepest slot a plan may admit runs a pass for nothing
    # (its price, read at its own passes' correction, is no reason to).
    slots = np.arange(width)[None, :] < ceilings[:, None]
    deepest = int(np.nonzero((slots & (survival > 0.0)).any(axis=0))[0].max(initial=-1))
    js = [fixed_k_step] if fixed_k_step is not None else range(deepest + 2)
    best = -1.0
    for j in js:
        if j == 0:
            best = max(best, batch / (plan_seconds(pricer, batch, base, 0, 0, width) + plain_owed * batch))
            continue
        allowed = np.arange(width)[None, :] < np.minimum(ceilings, j)[:, None]
        values = np.sort(survival[allowed & (survival > 0.0)])[::-1]
        gains = np.concatenate([[0.0], np.cumsum(values)]).tolist()
        for n, gain in enumerate(gains):
            if n == 0 and fixed_k_step is None:
                continue  # draft passes and nothing to verify: never the plan
            seconds = plan_seconds(pricer, batch, base, j, n, width)
            best = max(best, (batch + gain) / (seconds + owed * (batch + gain)))
    return best


def random_case(rng):
    """A random policy input: survival table, ceilings, base tokens, pricer."""
    batch, width = int(rng.integers(1, 33)), int(rng.integers(1, 9))
    alpha = rng.uniform(0.02, 1.0, size=(batch, width)) ** rng.uniform(0.1, 2.0)
    survival = np.cumprod(alpha, axis=1)
    ceilings = (rng.integers(0, width + 1, size=batch) if rng.random() < 0.4
                else np.full(batch, width))
    base = float(batch + (int(rng.choice([1, 16, 200, 1500])) if rng.random() < 0.4 else 0))
    profile = random_profile(rng, max_tokens=int(rng.choice([64, 512, 4096])))
    corr = ProfileCorrection(step=0.3)
    if rng.random() < 0.7:  # live corrections: a different ratio per shape
        for _ in range(400):
            seen = batch if rng.random() < 0.5 else int(rng.integers(1, 65))
            corr.observe(float(rng.integers(1, 6000)), seen, 1.0,
                         float(rng.lognormal(0.0, 0.5)))
    fixed = int(rng.integers(0, width + 1)) if rng.random() < 0.2 else None
    return survival, ceilings, base, StepPricer(profile, corr), fixed


def random_debt(rng, batch):
    """A pending catch-up and what a plain step adds to it (seconds), and the
    tokens left to spread them over, or none."""
    if rng.random() < 0.5:
        return 0.0, None, 0.0
    return (float(rng.choice([0.0, rng.uniform(0.0, 2.0)])), float(rng.integers(1, 64 * batch + 2)),
            float(rng.choice([0.0, rng.uniform(0.0, 1.0)])))


def test_goodput_argmax_equals_the_enumeration_of_every_plan():
    rng = np.random.default_rng(12)
    drafted = pinned = prefill = padded = owing = 0
    for _ in range(300):
        survival, ceilings, base, pricer, fixed = random_case(rng)
        batch = survival.shape[0]
        catch_up, horizon, skip = random_debt(rng, batch) if fixed is None else (0.0, None, 0.0)
        d = GoodputPolicy(min_gain=0.0).decide(survival, ceilings, base, pricer, fixed,
                                               catch_up, horizon, skip)
        best = best_rate_by_enumeration(survival, ceilings, base, pricer, fixed, catch_up, horizon,
                                        skip)
        # The decision's own plan, priced independently.
        assert d.predicted_tokens == pytest.approx(
            batch + sum(survival[r, :k].sum() for r, k in enumerate(d.k.tolist())), rel=1e-12)
        seconds = plan_seconds(pricer, batch, base, d.k_step, int(d.k.sum()), survival.shape[1])
        if d.k_step:
            seconds += owed_per_token(pricer, batch, base, catch_up, horizon) * d.predicted_tokens
        elif horizon is not None:
            seconds += skip / max(horizon, 1.0) * batch
        rate = d.predicted_tokens / seconds
        assert rate == pytest.approx(best, rel=1e-9)
        assert (d.k <= np.minimum(ceilings, d.k_step)).all()
        if fixed is not None:
            assert d.k_step == fixed
        elif d.k_step:
            assert d.k_step == d.k.max()  # no draft pass for nothing
        drafted += d.k_step > 0
        pinned += fixed is not None
        prefill += base > batch
        padded += pricer.profile.pad_sizes is not None
        owing += horizon is not None and d.k_step > 0
    # The cases cover plans that draft, pinned K_step, prefill chunks,
    # padding, and drafting plans that owe a catch-up or a prefill pass.
    assert min(drafted, pinned, prefill, padded, owing) > 30, (
        drafted, pinned, prefill, padded, owing)


def test_goodput_argmax_is_the_best_of_every_per_request_k():
    # Tiny batches, every vector of per-request k and every K_step: the
    # top-n restriction of the enumeration above loses nothing.
    rng = np.random.default_rng(13)
    for _ in range(150):
        batch, width = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        survival = np.cumprod(rng.uniform(0.05, 1.0, size=(batch, width)), axis=1)
        ceilings = rng.integers(0, width + 1, size=batch)
        base = float(batch + (int(rng.integers(1, 300)) if rng.random() < 0.3 else 0))
        pricer = StepPricer(random_profile(rng, max_tokens=64))
        best = batch / plan_seconds(pricer, batch, base, 0, 0, width)
        for k in itertools.product(*[range(c + 1) for c in ceilings.tolist()]):
            for j in range(max(max(k), 1), width + 1):
                if not any(k):
                    continue
                tokens = batch + sum(survival[r, :kr].sum() for r, kr in enumerate(k))
                best = max(best, tokens / plan_seconds(pricer, batch, base, j, sum(k), width))
        d = GoodputPolicy(min_gain=0.0).decide(survival, ceilings, base, pricer)
        rate = d.predicted_tokens / plan_seconds(pricer, batch, base, d.k_step, int(d.k.sum()),
                                                  survival.shape[1])
        assert rate == pytest.approx(best, rel=1e-9)


def test_goodput_speculates_only_past_min_gain():
    rng = np.random.default_rng(14)
    for _ in range(100):
        survival, ceilings, base, pricer, _ = random_case(rng)
        batch = survival.shape[0]
        plain = batch / plan_seconds(pricer, batch, base, 0, 0, survival.shape[1])
        best = best_rate_by_enumeration(survival, ceilings, base, pricer, None)
        d = GoodputPolicy(min_gain=0.05).decide(survival, ceilings, base, pricer, None)
        assert (d.k_step > 0) == (best >= 1.05 * plain)
        if d.k_step == 0:
            assert not d.k.any() and d.predicted_seconds == pytest.approx(d.plain_seconds)
        else:
            assert d.predicted_speedup >= 1.05 * (1 - 1e-9) or base > batch


def test_a_prefill_chunk_is_priced_at_the_plans_own_correction():
    # Plain steps with a 2048-token chunk measured 30% over their profile,
    # drafting steps of that size never measured.  The chunk costs the same
    # whatever is drafted; priced with the plain bucket's correction and
    # taken off a drafting plan priced with the drafting one, it left the
    # plan's decode work almost no time, and drafts accepted 5% of the time
    # were planned for the whole batch.
    profile = prior_profile("cpu", None, 4096, 64)  # n-gram on a CPU
    pricer = StepPricer(profile)
    for _ in range(15):
        pricer.observe(2052, 4, 0, 1.3 * profile.step(2052, 4, 0))
    bad = np.tile(0.05 ** np.arange(1, 5), (4, 1))
    ceilings = np.full(4, 4)
    policy = GoodputPolicy()
    for base in (4.0, 2052.0):
        d = policy.decide(bad, ceilings, base, pricer)
        assert d.k_step == 0 and not d.k.any(), base
    good = np.tile(0.9 ** np.arange(1, 5), (4, 1))
    d = policy.decide(good, ceilings, 2052.0, pricer)
    assert d.k_step > 0
    # Its predicted seconds are the whole step's.
    assert d.predicted_seconds == pytest.approx(
        pricer.seconds(2052 + d.k.sum(), 4, d.k_step))


def test_goodput_policy_direct_threshold():
    profile = StepProfile([1, 64], [1.0, 1.0 + 0.1 * 63], [0.0, 0.0], [1, 64], [0.05, 0.05])
    pol = GoodputPolicy(min_gain=0.0)
    survival = np.array([[0.9, 0.81, 0.73, 0.66], [0.05, 0.0025, 0.0, 0.0]])
    d = pol.decide(survival, np.array([4, 4]), 2.0, StepPricer(profile))
    assert d.k[0] >= 3 and d.k[1] == 0 and d.k_step == d.k.max()
    assert d.predicted_speedup > 1.0
    # Ceilings hold even where verifying looks free.
    free = StepProfile([1, 64], [1.0, 1.0], [0.0, 0.0], [1], [0.0])
    d = pol.decide(np.array([[0.9, 0.8, 0.7, 0.6]] * 2), np.array([0, 2]), 2.0, StepPricer(free))
    assert d.k.tolist() == [0, 2]


def test_a_catch_up_is_spread_over_the_tokens_the_batch_has_left():
    # Zero-cost fallback.  With tokens_left (max_tokens less the output) the
    # pending catch-up is paid once for drafting over the rest of the batch's
    # tokens: perfect drafts resume after any fallback while enough tokens
    # are left to win it back, and stay in fallback (no probe either) when
    # too few are.  Without tokens_left the horizon is unknown and nothing is
    # charged.  Either way a plan that drafts reports it in its seconds.
    profile = tiny_serve_profile()
    ctrl = SpecController(ControllerSettings(max_k=4), profile)
    for r in ("a", "b"):
        ctrl.add_request(r)
    for _ in range(20):
        ctrl.observe_verifications(["a", "b"], [4, 4], [4, 4])
    catch_up = profile.catchup(20000)  # one second: a long fallback
    base = ctrl.plan(["a", "b"])
    owed = ctrl.plan(["a", "b"], catchup_tokens=20000)
    assert owed.k.tolist() == base.k.tolist() == [4, 4]
    assert owed.predicted_seconds - base.predicted_seconds == pytest.approx(catch_up)
    many = ctrl.plan(["a", "b"], catchup_tokens=20000, tokens_left=[1002, 1002])
    assert many.k.tolist() == [4, 4]
    assert many.predicted_seconds == pytest.approx(
        ctrl.plan(["a", "b"], tokens_left=[1002, 1002]).predicted_seconds + catch_up)
    few = ctrl.plan(["a", "b"], catchup_tokens=20000, tokens_left=[12, 12])
    assert few.k_step == 0 and few.k.tolist() == [0, 0]
    for _ in range(40):  # due probes go through the same argmax, catch-up included
        assert ctrl.plan(["a", "b"], catchup_tokens=20000, tokens_left=[12, 12]).k_step == 0
    # A small catch-up (a few skipped steps) is won back in a few tokens.
    assert ctrl.plan(["a", "b"], catchup_tokens=8, tokens_left=[12, 12]).k.tolist() == [4, 4]





def test_a_step_that_prefills_drafts_when_drafting_pays():
    # Zero-cost fallback.  In a step that prefills a new prompt, drafting
    # costs the draft's pass over it; not drafting skips the prompt, which
    # the draft then passes over as a catch-up when drafting resumes a step
    # later, so it is paid either way.  Like the catch-up, it is spread over
    # the batch's tokens left: good drafts draft through the new prompt, at
    # one request and at four, and too few tokens left still stay plain.
    prompt = 150
    for batch in (1, 4):
        ctrl = SpecController(ControllerSettings(max_k=8), qwen_cpu_profile())
        old = [f"old{i}" for i in range(4)]
        for r in old:  # earlier requests teach the pool code-like acceptance
            ctrl.add_request(r)
        for _ in range(6):
            ctrl.observe_verifications(old, [4] * 4, [3] * 4)
        for r in old:
            ctrl.finish_request(r)
        live = [f"live{i}" for i in range(batch - 1)]
        for r in live + ["new"]:
            ctrl.add_request(r)
        for _ in range(6):
            if live:
                ctrl.observe_verifications(live, [4] * len(live), [3] * len(live))
        ids = live + ["new"]
        d = ctrl.plan(ids, base_tokens=batch - 1 + prompt, tokens_left=[42] * (batch - 1) + [64])
        # The argmax's own plan (not a probe, which predicts no tokens).
        assert d.k.min() > 0 and d.predicted_tokens > batch + 1, (batch, d)
        # The draft's pass over the prompt is in the step's predicted seconds.
        profile = ctrl.profile
        assert d.predicted_seconds > profile.step(batch - 1 + prompt + int(d.k.sum()), batch, 0)
        few = ctrl.plan(ids, base_tokens=batch - 1 + prompt, tokens_left=[2] * (batch - 1) + [3])
        assert few.k_step == 0, (batch, few)



def test_leaving_drafting_costs_a_catch_up_so_break_even_does_not_flap():
    # Zero-cost fallback.  A plain step leaves the draft behind: drafting
    # again needs a catch-up from each request's KV block start, over half a
    # second for four requests here, which a plain step is charged (spread
    # over the tokens left) as a drafting step is charged paying it.  Near
    # break-even the policy keeps what it does, drafting or plain; clearly
    # bad drafts still go plain, and good ones still resume.
    ids = ["a", "b", "c", "d"]
    caps = [50] * 4
    fresh_skip = 4 * 90  # back to each block's start, if this step skipped the draft

    def argmax_drafts(accepted, **kw):
        """Whether the argmax's plan drafts (the four requests are alike: all or none).

        A plan that drafts for nobody leaves them in fallback, where a probe
        may go out with the plan: that is the argmax choosing plain."""
        ctrl = SpecController(ControllerSettings(max_k=8), qwen_cpu_profile())
        for r in ids:
            ctrl.add_request(r)
        for a in accepted * 5:  # one draft a step, accepted or not
            ctrl.observe_verifications(ids, [1] * 4, [a] * 4)
        d = ctrl.plan(ids, tokens_left=[c + 2 for c in caps], **kw)
        return bool(d.k.sum() > 0) and ctrl.stats.probes_sent == 0

    # A third of the drafts accepted: drafting and plain price within a few
    # percent of each other at four requests.
    near = [0, 1, 0]
    assert not argmax_drafts(near)  # priced on this step alone, plain wins narrowly
    assert argmax_drafts(near, catchup_if_plain=fresh_skip)  # leaving costs a catch-up
    # Once in fallback, coming back costs it: the same estimates stay plain.
    assert not argmax_drafts(near, catchup_tokens=fresh_skip, catchup_if_plain=fresh_skip + 4)
    assert not argmax_drafts([0], catchup_if_plain=fresh_skip)
    assert argmax_drafts([1, 1, 0], catchup_tokens=fresh_skip, catchup_if_plain=fresh_skip + 4)


# -- convex verify prices ------------------------------------------------------------

# The Qwen pair's start-up profile as the grid's adaptive arm measured it:
# one verified token 0.197 s, two 0.266 s, nine 0.201 s (a point a repeat
# does not reproduce: vLLM's static K's served steps show no such jump).
NOISY = StepProfile(tokens=[1, 2, 4, 9, 18, 36], target_s=[0.197, 0.266, 0.205, 0.201, 0.26, 0.40],
                    first_s=[0.0] * 6, batch=[1, 4], pass_s=[0.05, 0.06],
                    meta={"source": "test", "platform": "cpu"})
LINEAR = StepProfile(tokens=[1, 64], target_s=[0.1, 0.1 + 63 * 0.01], first_s=[0.02, 0.02],
                     batch=[1, 4], pass_s=[0.05, 0.06], meta={"source": "test", "platform": "cpu"})


def by_n(profile, batch=1, width=8):
    return GoodputPolicy().prices(batch, width, float(batch), StepPricer(profile)).by_n


def test_a_noisy_point_is_spread_not_charged_to_one_place():
    prices = by_n(NOISY)
    slot = np.diff(prices)
    assert np.all(slot >= 0) and np.all(np.diff(slot) >= -1e-12)  # rising, convex
    # The running maximum charged the first draft 0.069 s, a third of a step,
    # and the next seven nothing; spread, no place costs more than 2% of a step.
    assert np.diff(np.maximum.accumulate(NOISY.verify_and_first(1.0 + np.arange(9))))[0] > 0.06
    assert slot.max() < 0.02 * 0.197
    assert prices[0] == NOISY.target(1)


def test_a_convex_rising_curve_is_priced_as_measured():
    tokens = 1.0 + np.arange(4 * 8 + 1)
    np.testing.assert_allclose(by_n(LINEAR, batch=1), LINEAR.verify_and_first(tokens[:9]))
    np.testing.assert_allclose(convex_rise([1.0, 2.0, 4.0, 7.0]), [1.0, 2.0, 4.0, 7.0])
    # A dip comes first in a convex fit and is floored at the step's own price.
    np.testing.assert_allclose(convex_rise([0.13, 0.125, 0.12, 0.14]), [0.13, 0.13, 0.13, 0.14])
