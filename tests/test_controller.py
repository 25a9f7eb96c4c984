"""Unit tests of the controller: no vLLM, no wall clock, milliseconds each.

Every verdict is taken against a fixed step-cost profile (``StepProfile``):
the simulated steps below take the profile's own price (with lognormal noise,
or a warm-up slowdown where a test says so), and those times reach the
controller only through ``observe_step``, as the scheduler's would.
"""

import itertools
import math

import numpy as np
import pytest

from vllm_specplug.controller import (
    AcceptanceEstimator,
    ControllerSettings,
    GoodputPolicy,
    ProfileCorrection,
    SpecController,
    StepPricer,
    StepProfile,
    prior_profile,
)

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


# -- the acceptance estimator ----------------------------------------------------

def test_estimator_converges_per_position():
    est = AcceptanceEstimator(4, forgetting=0.98)
    est.add("a")
    rng = np.random.default_rng(0)
    for _ in range(400):
        est.observe("a", 4, simulate_verification(rng, 0.8, 4))
    alpha = est.conditional(np.array([est.row("a")]))[0]
    assert np.allclose(alpha, 0.8, atol=0.1)
    surv = est.survival(np.array([est.row("a")]))[0]
    assert np.all(np.diff(surv) <= 1e-12)


def test_estimator_handles_censoring():
    # Accepting all of 2 drafts says nothing against positions 3-4 (they
    # were never tested: no failure is counted there), and a failure at
    # position 1 says nothing about position 2.
    est = AcceptanceEstimator(4, initial_acceptance=0.5)
    est.add("a")
    for _ in range(50):
        est.observe("a", 2, 2)
    row = np.array([est.row("a")])
    assert est._trials[row][0].tolist()[2:] == [0.0, 0.0]
    alpha = est.conditional(row)[0]
    assert alpha[0] > 0.9 and alpha[1] > 0.9 and alpha[3] > 0.5
    est.add("b")
    for _ in range(50):
        est.observe("b", 4, 0)
    assert est._trials[np.array([est.row("b")])][0, 1] == 0.0


def test_estimator_shrinks_new_request_toward_global_profile():
    est = AcceptanceEstimator(2)
    for i in range(20):
        est.add(f"old{i}")
        for _ in range(10):
            est.observe(f"old{i}", 2, 0)
    est.add("new")
    alpha_new = est.conditional(np.array([est.row("new")]))[0]
    assert alpha_new[0] < 0.2


def test_estimator_pool_follows_a_change_of_workload_within_a_few_requests():
    # Ten requests whose drafts are all accepted, then two whose drafts are
    # all rejected: the third of the new kind starts from the new kind's
    # acceptance, not the old one's (the pool covers the last few requests,
    # not a fixed number of verifications).
    est = AcceptanceEstimator(2)
    for i, accepted in enumerate([2] * 10 + [0] * 2):
        est.add(f"r{i}")
        for _ in range(20):
            est.observe(f"r{i}", 2, accepted)
        est.remove(f"r{i}")
    est.add("next")
    assert est.conditional(np.array([est.row("next")]))[0, 0] < 0.5


def test_a_requests_opening_verification_is_not_evidence():
    # The drafts that open a response are verified at another rate than the
    # rest of it (recorded served traces: 0.62 against 0.95 on code): a
    # rejected opening neither moves the request's estimate nor the pool's;
    # the verifications after it do.
    est = AcceptanceEstimator(4)
    for i in range(3):
        est.add(f"old{i}")
        for _ in range(10):
            est.observe(f"old{i}", 4, 4)
        est.remove(f"old{i}")
    row = np.array([est.add("new")])
    pool, before = est.global_profile().copy(), est.survival(row)[0].copy()
    est.observe("new", 4, 0)
    assert np.allclose(est.survival(row)[0], before)
    assert np.allclose(est.global_profile(), pool)
    est.observe("new", 4, 0)
    assert est.survival(row)[0, 0] < before[0] - 0.1


def test_estimator_pools_alike_requests_and_keeps_different_ones_apart():
    # Ten forgotten observations of a 0.8 acceptance spread the estimates by
    # about +-0.13; a policy handing out slots by them favours the lucky
    # requests.  Alike requests are pulled hard toward the pool (their
    # spread is chance); easy and hard requests keep the weak configured pull.
    def run(alphas, seed):
        rng = np.random.default_rng(seed)
        est = AcceptanceEstimator(4, forgetting=0.9, prior_strength=0.5)
        rows = np.array([est.add(f"r{i}") for i in range(len(alphas))])
        for _ in range(60):
            drafted = np.full(len(alphas), 4)
            accepted = np.array([simulate_verification(rng, a, 4) for a in alphas])
            est.observe_rows(rows, drafted, accepted)
        return est, est.conditional(rows)[:, 0]

    alike, first = run([0.8] * 32, 0)
    assert alike.prior_strength >= 8
    assert first.std() < 0.05 and abs(first.mean() - 0.8) < 0.05
    apart, first = run([0.9] * 16 + [0.3] * 16, 1)
    assert apart.prior_strength < 8
    assert first[:16].mean() - first[16:].mean() > 0.4  # 0.6 apart
    # Too few requests to tell: a middle pull (see the next test).
    few, _ = run([0.8] * 4, 2)
    assert few.prior_strength == AcceptanceEstimator.POOL_FEW_STRENGTH


def test_a_lone_requests_deeper_positions_borrow_from_the_pool(monkeypatch):
    # One request, drafts accepted at 0.45 a position: position 2 is tried
    # only after position 1 was accepted, so its own estimate rests on a
    # handful of forgotten trials.  With the configured weak pull the
    # simulated 8B + EAGLE at one request on hard text took K=1 where K=2
    # pays (0.968 of the best static K).  With fewer requests than can be
    # compared the pull toward the pool (at one request, its own longer
    # history) is a middle one.
    def rms_error(few, seed):
        monkeypatch.setattr(AcceptanceEstimator, "POOL_FEW_STRENGTH", few)
        rng = np.random.default_rng(seed)
        est = AcceptanceEstimator(4, forgetting=0.9, prior_strength=0.5)
        row = np.array([est.add("a")])
        errors = []
        for i in range(300):
            est.observe_rows(row, np.array([4]), np.array([simulate_verification(rng, 0.45, 4)]))
            if i >= 100:
                errors.append(est.survival(row)[0, 1] - 0.45 ** 2)
        return float(np.sqrt(np.mean(np.square(errors))))

    weak = np.mean([rms_error(0.5, seed) for seed in range(5)])
    middle = np.mean([rms_error(4.0, seed) for seed in range(5)])
    assert middle < 0.85 * weak and middle < 0.08, (weak, middle)


def test_estimator_frees_and_reuses_rows():
    est = AcceptanceEstimator(2, initial_capacity=2)
    for i in range(10):
        est.add(f"r{i}")
    assert len(est) == 10
    for i in range(10):
        est.remove(f"r{i}")
    assert len(est) == 0
    est.add("x")
    assert est._trials[est.row("x")].sum() == 0


# -- the step-cost profile ---------------------------------------------------------

def test_profile_interpolates_pads_and_extrapolates():
    p = StepProfile([2, 10], [1.0, 3.0], [0.5, 0.5], [1, 5], [0.1, 0.3])
    # Piecewise linear between sizes, flat below the first, the last slope
    # past the last.
    assert p.target(1.0) == 1.0
    assert p.target(6.0) == pytest.approx(2.0)
    assert p.target(14.0) == pytest.approx(4.0)
    assert p.draft_pass(3.0) == pytest.approx(0.2)
    # A step runs at the next captured size, and unpadded past the largest.
    padded = StepProfile([2, 10], [1.0, 3.0], [0.5, 0.5], [1, 5], [0.1, 0.3],
                         pad_sizes=[12, 4, 8])
    assert padded.pad_sizes.tolist() == [4, 8, 12]
    assert padded.target(1.0) == padded.target(3.0) == pytest.approx(1.5)  # at 4
    assert padded.target(9.0) == pytest.approx(3.5)   # at 12, the last slope
    assert padded.target(13.0) == pytest.approx(3.75)  # eager
    assert padded.draft_pass(3.0) == pytest.approx(0.25)  # a batch of 3 runs at 4
    assert p.first(0.0) == 0.0
    assert p.step(8.0, 3.0, 0) == pytest.approx(p.target(8.0))
    assert p.step(8.0, 3.0, 1) == pytest.approx(p.target(8.0) + 0.5)
    assert p.step(8.0, 3.0, 3) == pytest.approx(p.target(8.0) + 0.5 + 2 * 0.2)
    # Without a catch-up curve a catch-up is priced as a first pass over the tokens.
    assert p.catchup(6.0) == pytest.approx(p.first(6.0))
    assert p.catchup(0.0) == 0.0
    # A falling last slope is not extrapolated downward.
    falling = StepProfile([1, 2], [2.0, 1.0], [0.0, 0.0], [1], [0.0])
    assert falling.target(100.0) == pytest.approx(1.0)


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


@pytest.mark.parametrize("seed", range(3))
def test_profile_scalar_and_array_prices_agree(seed):
    # The policy prices plain steps with the scalar lookups and drafting
    # steps with the array one: the two must be the same curve, single-size
    # profiles and captured sizes included.
    rng = np.random.default_rng(seed)
    for _ in range(60):
        p = random_profile(rng)
        x = np.concatenate([rng.integers(1, 5000, 40), p.tokens, p.tokens + 1]).astype(float)
        tf = [p.target(v) + p.first(v) for v in x.tolist()]
        assert np.allclose(p.verify_and_first(x), tf, rtol=1e-12)
    single = StepProfile([8], [1.0], [0.5], [4], [0.1])
    assert single.target(16.0) == pytest.approx(2.0)  # proportional past the one size
    assert single.verify_and_first(np.array([4.0, 16.0])).tolist() == pytest.approx([1.5, 3.0])


def test_a_measured_profile_is_fitted_non_decreasing_where_sizes_compare():
    from vllm_specplug.controller.profile import isotonic

    assert isotonic([1.0, 2.0, 3.0]).tolist() == [1.0, 2.0, 3.0]
    assert isotonic([3.0, 1.0, 2.0]).tolist() == pytest.approx([2.0, 2.0, 2.0])
    # The Qwen pair's medians on a busy 2-core host, timed one shape after
    # another (ms): steps over more tokens and draft passes over more
    # requests measured cheaper than smaller ones.
    noisy = StepProfile([1, 2, 4, 9, 18, 36], [175, 191, 118, 188, 290, 411],
                        [37, 79, 157, 55, 158, 256], [1, 2, 4], [81, 49, 67],
                        catchup_tokens=[20, 40, 80], catchup_s=[60, 50, 140])
    fit = noisy.monotone()
    for curve in (fit.pass_s, fit.catchup_s):
        assert (np.diff(curve) >= 0).all()
    # Least squares under the constraint: violators are pooled, the rest kept.
    assert fit.pass_s.tolist() == pytest.approx([65, 65, 67])
    # The token curves are kept as measured: each plan reads them from its
    # own step's size up (test_a_plans_prices_do_not_rise_with_a_smaller_shapes).
    assert fit.target_s.tolist() == noisy.target_s.tolist()
    assert fit.first_s.tolist() == noisy.first_s.tolist()
    assert fit.tokens.tolist() == noisy.tokens.tolist()
    assert fit.monotone().to_dict() == fit.to_dict()


def test_a_plans_prices_do_not_rise_with_a_smaller_shapes_and_never_dip():
    # Measured on an AMD EPYC host (Qwen pair, ms): a 1-request step slower
    # than a 4-request one, and the first pass dipping at 9 tokens.
    p = StepProfile([1, 2, 4, 9, 18, 36], [186, 164, 138, 201, 283, 415],
                    [73, 54, 87, 55, 94, 166], [1, 2, 4], [65, 62, 63])
    policy = GoodputPolicy(min_gain=0.0)
    pr = policy.prices(4, 8, 4.0, StepPricer(p.monotone()))
    # Plain decoding of 4 requests at its own measured price, not pooled
    # with the slower 1-request step.
    assert pr.plain == pytest.approx(138.0)
    assert pr.by_n[0] == pytest.approx(138.0 + 87.0)
    # A step over more tokens measured cheaper (noise): slots added to the
    # step are priced at least as the step without them, never below it.
    dip = StepProfile([1, 4, 9, 36], [100, 120, 90, 400], [10, 30, 5, 60], [1, 4], [20, 20])
    pr = policy.prices(4, 8, 4.0, StepPricer(dip.monotone()))
    assert (np.diff(pr.by_n) >= 0).all()
    assert pr.by_n[5] == pytest.approx(150.0)  # 9 tokens: the 4-token step's 120 + 30
    # A prefill chunk that lands in the dip costs nothing, not less than nothing.
    pr = policy.prices(4, 8, 9.0, StepPricer(dip.monotone()))
    assert pr.prefill_p == 0.0


def test_profile_json_round_trip(tmp_path):
    p = StepProfile([1, 16, 256], [1e-3, 1.2e-3, 4e-3], [2e-4, 2.5e-4, 9e-4], [1, 8, 64],
                    [1e-4, 1.5e-4, 4e-4], catchup_tokens=[16, 256], catchup_s=[3e-4, 2e-3],
                    pad_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                    meta={"source": "measured", "gpu": "H200", "tp": 2})
    path = tmp_path / "profile.json"
    p.save(str(path))
    q = StepProfile.load(str(path))
    assert q.to_dict() == p.to_dict()
    for tokens, batch, k_step, catchup in [(1, 1, 0, 0), (3, 2, 1, 0), (100, 8, 4, 40),
                                           (300, 64, 8, 1000)]:
        assert q.step(tokens, batch, k_step, catchup) == p.step(tokens, batch, k_step, catchup)
    assert q.meta == {"source": "measured", "gpu": "H200", "tp": 2}
    # Optional parts may be left out of the file.
    bare = StepProfile.from_dict({k: p.to_dict()[k]
                                  for k in ("tokens", "target_s", "first_s", "batch", "pass_s")})
    assert bare.pad_sizes is None and bare.catchup_tokens is None and bare.meta == {}
    assert "| 16 |" in p.table()


@pytest.mark.parametrize("args, message", [
    (([1, 2], [1.0], [0.0, 0.0], [1], [0.1]), "tokens, target_s and first_s"),
    (([1, 2], [1.0, 2.0], [0.0], [1], [0.1]), "tokens, target_s and first_s"),
    (([1, 2], [1.0, 2.0], [0.0, 0.0], [1, 2], [0.1]), "batch and pass_s"),
    (([2, 2], [1.0, 2.0], [0.0, 0.0], [1], [0.1]), "strictly increasing"),
    (([1, 4], [1.0, 2.0], [0.0, 0.0], [8, 2], [0.1, 0.2]), "strictly increasing"),
    (([1, 4], [0.0, 2.0], [0.0, 0.0], [1], [0.1]), "target_s must be positive"),
    (([1, 4], [-1.0, 2.0], [0.0, 0.0], [1], [0.1]), "target_s must be positive"),
    (([1, 4], [float("nan"), 2.0], [0.0, 0.0], [1], [0.1]), "target_s must be positive"),
    (([1, 4], [1.0, float("inf")], [0.0, 0.0], [1], [0.1]), "target_s must be positive"),
    (([], [], [], [1], [0.1]), "at least one size"),
    (([1], [1.0], [0.0], [1], [0.1], [4, 8], None), "come together"),
    (([1], [1.0], [0.0], [1], [0.1], [4, 8], [0.1]), "catchup_tokens and catchup_s must"),
])
def test_profile_validation_errors(args, message):
    with pytest.raises(ValueError, match=message):
        StepProfile(*args)


def test_profile_from_dict_names_what_is_missing():
    with pytest.raises(ValueError, match="lacks first_s, pass_s"):
        StepProfile.from_dict({"tokens": [1], "target_s": [1.0], "batch": [1]})


def test_prior_profile_shapes():
    cpu = prior_profile("cpu", 0.3, 512, 64)
    gpu = prior_profile("cuda", 0.3, 512, 64)
    # On a CPU verifying 4 drafts costs about 2x a plain step; on a GPU
    # small steps are memory-bound.
    assert cpu.target(5.0) / cpu.target(1.0) == pytest.approx(2.0, rel=0.05)
    assert gpu.target(5.0) / gpu.target(1.0) < 1.1
    assert cpu.first(8.0) > 0 and cpu.draft_pass(8) > 0
    lookup = prior_profile("cpu", None, 512, 64)  # n-gram: host work, nearly free
    assert lookup.first(8.0) == 0.0 and lookup.draft_pass(8) < 0.1 * lookup.target(1.0)
    at_k0 = prior_profile("cpu", 0.3, 512, 64, draft_runs_at_k0=True)
    assert at_k0.first(8.0) == 0.0
    assert at_k0.target(8.0) == pytest.approx(cpu.target(8.0) + cpu.first(8.0))


# -- the live correction --------------------------------------------------------------

def test_correction_tracks_the_median_not_the_mean():
    # Steps measured 1.3x their profile with 5% noise, and one in five a
    # 10x stall: the median ratio is about 1.32, the mean well past 2.
    corr = ProfileCorrection()
    rng = np.random.default_rng(0)
    for _ in range(600):
        ratio = 1.3 * rng.lognormal(0.0, 0.05) * (10.0 if rng.random() < 0.2 else 1.0)
        assert corr.observe(40, 1, 1.0, ratio)
    assert 1.25 <= corr.ratio(40, 1) <= 1.4
    assert corr.observations == 600
    # Token bands no step has visited are priced at the level common to all
    # steps, which here are all of one band.
    assert corr.ratio(8, 1) == corr.ratio(128, 1) == pytest.approx(corr.ratio(40, 1), rel=0.05)
    assert corr.ratio(32, 1) == corr.ratio(63, 1) == corr.ratio(40, 1)


def test_correction_absorbs_a_steady_mismatch_within_a_few_dozen_steps():
    corr = ProfileCorrection()
    for i in range(25):
        corr.observe(4, 1, 2e-3, 1.5 * 2e-3)
    assert corr.ratio(4, 1) == pytest.approx(1.5, rel=0.02)


@pytest.mark.parametrize("measured, bound", [(10.0, 2.0), (0.01, 0.5)])
def test_correction_is_clipped(measured, bound):
    corr = ProfileCorrection()
    for _ in range(200):
        corr.observe(100, 1, 1.0, measured)
    assert corr.ratio(100, 1) == pytest.approx(bound)


def test_correction_drops_garbage():
    corr = ProfileCorrection()
    for profiled, measured in [(1.0, float("nan")), (1.0, -1.0), (1.0, 0.0),
                               (1.0, float("inf")), (1.0, -float("inf")),
                               (0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0)]:
        assert corr.observe(8, 1, profiled, measured) is False
    assert corr.observations == 0
    assert not corr._log.any()


def test_a_single_stall_moves_the_ratio_by_at_most_one_step():
    corr = ProfileCorrection(forget=0.0)  # the step rule alone
    for _ in range(50):
        corr.observe(16, 1, 1.0, 1.0)
    corr.observe(16, 1, 1.0, 100.0)
    assert corr.ratio(16, 1) == pytest.approx(math.exp(corr.step))
    corr.observe(16, 1, 1.0, 1.0)
    assert corr.ratio(16, 1) == pytest.approx(1.0)
    corr.observe(16, 1, 1.0, 0.01)
    assert corr.ratio(16, 1) == pytest.approx(math.exp(-corr.step))


def test_an_unvisited_band_is_forgotten_back_to_the_profile():
    corr = ProfileCorrection()
    for _ in range(100):
        corr.observe(16, 1, 1.0, 2.0)  # steps of 16-31 tokens measured 2x the profile
    high = corr.ratio(16, 1)
    assert high > 1.5
    for _ in range(600):
        corr.observe(200, 1, 1.0, 1.0)  # then only larger steps
    assert 1.0 <= corr.ratio(16, 1) < 1.0 + 0.35 * (high - 1.0)
    # A visited band keeps its measured ratio despite the forgetting.
    for _ in range(300):
        corr.observe(16, 1, 1.0, 1.5)
    assert corr.ratio(16, 1) == pytest.approx(1.5, rel=0.08)


def test_correction_ratios_from_matches_ratio():
    # The policy reads a run of token counts at once; it must be the ratio
    # of each count's own band.
    corr = ProfileCorrection(step=0.3)
    rng = np.random.default_rng(1)
    for _ in range(600):
        corr.observe(float(rng.integers(1, 1 << 14)), int(rng.integers(1, 9)), 1.0,
                     float(rng.lognormal(0.0, 0.6)))
    for _ in range(100):
        start, count = int(rng.integers(1, 9000)), int(rng.integers(1, 700))
        batch = int(rng.integers(1, 9))
        got = corr.ratios_from(start, count, batch)
        want = [corr.ratio(t, batch) for t in range(start, start + count)]
        assert got.shape == (count,) and np.allclose(got, want, rtol=1e-12)


def test_observe_step_corrects_the_profile_price_and_nothing_else():
    profile = tiny_serve_profile()
    before = profile.to_dict()
    ctrl = SpecController(ControllerSettings(max_k=4), profile)
    assert ctrl.profile is profile
    for _ in range(30):
        assert ctrl.observe_step(1, 5, 4, 1.2 * profile.step(5, 1, 4))
    assert not ctrl.observe_step(1, 5, 4, float("nan"))
    assert ctrl.profile.to_dict() == before
    corr = ctrl.pricer.correction
    assert corr.observations == 30
    assert corr.ratio(5, 1) == pytest.approx(1.2, rel=0.03)
    # The pricer prices with it, a plain step of the shape as a drafting one.
    assert ctrl.pricer.seconds(5, 1, 4) == pytest.approx(corr.ratio(5, 1) * profile.step(5, 1, 4))
    assert ctrl.pricer.seconds(5, 1, 0) == pytest.approx(corr.ratio(5, 1) * profile.step(5, 1, 0))
    # Five requests decoding plainly are another shape, never run: the
    # profile's price at the level common to all steps.
    common = corr.learnt()["common"]
    assert ctrl.pricer.seconds(5, 5, 0) == pytest.approx(common * profile.step(5, 5, 0), rel=1e-3)
    # A catch-up is part of the step its profile price is compared with.
    assert ctrl.observe_step(1, 5, 4, profile.step(5, 1, 4, 64), catchup_tokens=64)


def test_a_ratio_learnt_at_one_request_does_not_price_a_batch_of_four():
    # One request drafting 7-8 tokens a step (9 tokens) ran at 0.6x its
    # profile; then four requests arrive, whose steps of one draft each
    # also carry 8-9 tokens but four times the draft's work per pass and
    # four contexts.  A ratio shared by token count alone priced those at
    # 0.6x too and made drafting look 60% cheaper than plain decoding at
    # four requests, which had never been measured: the batch of four must
    # be priced as a fresh profile prices it, at the common level, until its
    # own steps are seen.
    profile = prior_profile("cpu", 0.1, 4096, 64)
    pricer, fresh = StepPricer(profile), StepPricer(profile)
    for i in range(100):
        k = 7 + i % 2
        assert pricer.observe(1 + k, 1, k, 0.6 * profile.step(1 + k, 1, k))
    assert pricer.seconds(9, 1, 8) == pytest.approx(0.6 * profile.step(9, 1, 8), rel=0.03)
    policy = GoodputPolicy()
    survival = np.cumprod(np.full((4, 4), 0.5), axis=1)
    ceilings = np.full(4, 4)
    want = policy.decide(survival, ceilings, 4, fresh)
    got = policy.decide(survival, ceilings, 4, pricer)
    assert want.k_step == 0  # drafting does not pay at four requests here
    assert (got.k_step, got.k.tolist()) == (want.k_step, want.k.tolist())
    assert got.predicted_speedup == pytest.approx(want.predicted_speedup)
    common = pricer.correction.learnt()["common"]
    assert common == pytest.approx(0.6, rel=0.03)
    for tokens in range(4, 40):
        assert pricer.seconds(tokens, 4, 1) == pytest.approx(common * fresh.seconds(tokens, 4, 1),
                                                             rel=1e-3)


def test_plain_steps_price_the_plain_shape_a_drafting_batch_never_runs():
    # The Qwen pair on this CPU: the start-up profile priced plain steps 13%
    # over what they measured, drafting steps right.  Plain steps ran only
    # where a request at one request fell back; at four requests the plan
    # drafted every step, so the plain step of four requests was priced at
    # the drafting steps' level, 13% high, and drafting that measured no
    # faster than plain was planned every step.  The plain steps' offset,
    # learnt at one request, prices the plain step of four.
    profile = QWEN_CPU
    pricer = StepPricer(profile)
    for i in range(200):
        k = 3 + i % 3
        assert pricer.observe(1 + k, 1, k, profile.step(1 + k, 1, k))   # drafting: as profiled
        if i % 10 == 0:
            assert pricer.observe(1, 1, 0, 0.87 * profile.step(1, 1, 0))  # plain: 13% under
    for _ in range(100):
        assert pricer.observe(8, 4, 1, profile.step(8, 4, 1))
    corr = pricer.correction
    assert corr.learnt()["plain"] == pytest.approx(0.87, rel=0.04)
    assert pricer.seconds(4, 4, 0) == pytest.approx(0.87 * profile.step(4, 4, 0), rel=0.04)
    # Drafting prices are the drafting steps' own.
    assert pricer.seconds(8, 4, 1) == pytest.approx(profile.step(8, 4, 1), rel=0.02)
    assert pricer.seconds(12, 4, 2) == pytest.approx(profile.step(12, 4, 2), rel=0.02)
    # Drafts that pay against the profile's plain price but not against the
    # measured one are not planned.
    policy = GoodputPolicy()
    fresh = StepPricer(profile)
    ceilings = np.full(4, 4)
    for p in np.linspace(0.05, 0.95, 91):
        survival = np.cumprod(np.full((4, 4), p), axis=1)
        if policy.decide(survival, ceilings, 4, fresh).k_step > 0:
            break
    assert policy.decide(survival, ceilings, 4, fresh).k_step > 0
    assert policy.decide(survival, ceilings, 4, pricer).k_step == 0
    # A plain step with a prefill chunk corrects its own shape, not the offset.
    before = corr.learnt()["plain"]
    for _ in range(20):
        pricer.observe(2052, 4, 0, 1.3 * profile.step(2052, 4, 0))
    assert corr.learnt()["plain"] == pytest.approx(before, rel=0.05)


def test_shapes_the_policy_never_runs_are_priced_at_the_level_of_those_it_runs():
    # Served ShareGPT at four requests, Qwen 1.5B + 0.5B on a CPU, with a
    # profile cached when the host ran 1.3x slower: steps of four requests
    # verifying three drafts each (16 tokens) and plain steps measured 0.78x
    # their price.  Priced at the raw profile, the 12 tokens of drafting two
    # each (another band, never run) looked 1.3x dearer than they are, and
    # the policy drafted three where two pay more (vLLM's K=2 beat it there).
    ms = 1e-3
    profile = StepProfile([1, 2, 4, 9, 18, 36],
                          [173.3 * ms, 182.8 * ms, 182.8 * ms, 191.5 * ms, 233.6 * ms, 267.3 * ms],
                          [71.9 * ms] * 5 + [85.5 * ms], [1, 2, 4],
                          [68.7 * ms, 69.8 * ms, 71.2 * ms], meta={"zero_cost_fallback": True})
    fresh, pricer = StepPricer(profile), StepPricer(profile)
    for i in range(200):
        tokens, k_step = (16, 3) if i % 4 else (4, 0)
        assert pricer.observe(tokens, 4, k_step, 0.78 * profile.step(tokens, 4, k_step))
    survival = np.cumprod(np.full((4, 8), 0.78), axis=1)  # the estimates served
    want = GoodputPolicy().decide(survival, np.full(4, 8), 4, fresh)
    got = GoodputPolicy().decide(survival, np.full(4, 8), 4, pricer)
    assert want.k_step == 2
    assert (got.k_step, got.k.tolist()) == (want.k_step, want.k.tolist())
    assert pricer.seconds(12, 4, 2) == pytest.approx(0.78 * profile.step(12, 4, 2), rel=0.03)


def test_a_mismatch_learnt_on_drafting_steps_prices_plain_steps_too():
    # The engine runs 1.3x slower than its profile (a busier host, longer
    # contexts), and every step the policy runs drafts.  The correction must
    # raise plain decoding's price with drafting's: learnt for drafting
    # steps alone, it would make plain look 1.3x cheaper than drafting,
    # flip the policy to plain, and go stale there in turn.
    pricer = StepPricer(MODERATE)
    policy = GoodputPolicy()
    survival = np.cumprod(np.full((8, 4), 0.6), axis=1)
    ceilings = np.full(8, 4)
    before = policy.decide(survival, ceilings, 8, pricer)
    assert before.k_step >= 1 and 1.05 < before.predicted_speedup < 1.3
    for i in range(300):
        tokens = 8 + i % 25  # every size a plan of this batch can take
        measured = 1.3 * MODERATE.step(tokens, 8, before.k_step)
        assert pricer.observe(tokens, 8, before.k_step, measured)
    after = policy.decide(survival, ceilings, 8, pricer)
    assert (after.k_step, after.k.tolist()) == (before.k_step, before.k.tolist())
    assert after.predicted_speedup == pytest.approx(before.predicted_speedup, rel=0.01)
    assert after.predicted_seconds == pytest.approx(1.3 * before.predicted_seconds, rel=0.03)


# -- the goodput policy: closed loops ------------------------------------------------

def test_goodput_climbs_to_the_ceiling_on_a_memory_bound_profile():
    # Exact step times: the correction stays at the profile, so the climb is
    # the estimator's and the policy's.  (With 10% timing noise the
    # correction's running median can read the 64-127-token band 10% high;
    # on this nearly flat profile a plan of 63 tokens then beats the
    # ceiling's 72, and stays there until the band is forgotten back: the
    # last 30 steps were not all at the ceiling for 7 of 30 seeds.)
    ctrl = SpecController(ControllerSettings(max_k=8), GPU_LIKE)
    _, hist = drive(ctrl, [0.95] * 8, 150, np.random.default_rng(2), noise=0.0)
    assert hist[0].k.max() < 8  # from the prior (0.6 a position)
    assert all(d.k.tolist() == [8] * 8 and d.k_step == 8 for d in hist[-30:])
    assert ctrl.num_in_fallback() == 0


def test_goodput_falls_back_when_drafts_are_bad():
    # Drafting would pay here for good drafts (the test above); these are
    # accepted 2% of the time.
    ctrl = SpecController(ControllerSettings(max_k=8), MODERATE)
    _, hist = drive(ctrl, [0.02], 200, np.random.default_rng(3))
    first_zero = next(i for i, d in enumerate(hist) if d.k[0] == 0)
    assert first_zero < 10
    late = [int(d.k[0]) for d in hist[-100:]]
    # Only sparse probes of a token or two remain.
    assert np.mean(late) < 0.15 and max(late) <= 2, late
    assert ctrl.stats.probes_sent > 0 and ctrl.num_in_fallback() == 1


@pytest.mark.parametrize("batch", [1, 8])
def test_goodput_falls_back_when_compute_bound_even_with_perfect_drafts(batch):
    ctrl = SpecController(ControllerSettings(max_k=4), CPU_BOUND)
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        ctrl.add_request(r)
    # The controller has seen every draft accepted for a long while ...
    for _ in range(40):
        ctrl.observe_verifications(ids, [4] * batch, [4] * batch)
    survival = ctrl.estimator.survival(np.arange(batch))
    assert survival.min() > 0.95
    # ... and still drafts nothing: each verified token costs a whole step.
    granted = drive_perfect_drafts(ctrl, batch, 100, np.random.default_rng(4),
                                   zero_cost_fallback=False)
    assert max(granted) == 0
    assert ctrl.stats.sum_k_step == 0 and ctrl.stats.probes_sent == 0
    # The same table on a memory-bound profile drafts to the ceiling.
    d = GoodputPolicy().decide(survival, np.full(batch, 4), float(batch), StepPricer(GPU_LIKE))
    assert d.k.tolist() == [4] * batch


def test_goodput_recovers_after_regime_change_through_probes():
    # Every request's drafts turn bad, then good again: nobody keeps the
    # proposer running, so only probes can bring speculation back, and they
    # bring it back to where a controller that never saw bad drafts is.
    settings = ControllerSettings(max_k=8)
    rng = np.random.default_rng(5)
    _, fresh = drive(SpecController(settings, MODERATE), [0.97] * 4, 150, rng)
    steady = np.mean([d.k.mean() for d in fresh[-30:]])
    steady_speedup = np.mean([d.predicted_speedup for d in fresh[-30:]])
    assert steady >= 5
    ctrl = SpecController(settings, MODERATE)
    _, bad = drive(ctrl, [0.02] * 4, 150, rng)
    assert all(d.k_step == 0 or d.k.max() <= 2 for d in bad[-50:])
    assert ctrl.num_in_fallback() == 4
    sent, succeeded = ctrl.stats.probes_sent, ctrl.stats.probes_succeeded
    assert sent > 0
    _, good = drive(ctrl, [0.97] * 4, 150, rng)
    recovered_at = next(i for i, d in enumerate(good) if d.k.min() >= 4)
    assert recovered_at <= settings.probe_max_interval + 16, [d.k.tolist() for d in good]
    # Back to where the fresh controller is: its predicted goodput (K=6 and
    # K=8 are within a percent of each other here, so the K itself is a tie).
    assert np.mean([d.k.mean() for d in good[-30:]]) >= 5
    # (The pooled acceptance still remembers the bad phase a little: 0.97 here.)
    assert np.mean([d.predicted_speedup for d in good[-30:]]) >= 0.95 * steady_speedup
    assert ctrl.stats.probes_succeeded > succeeded and ctrl.stats.recoveries >= 1
    assert ctrl.num_in_fallback() == 0


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


def test_a_plain_step_the_plan_never_runs_is_measured_by_a_plain_probe(monkeypatch):
    # Served at four requests on this CPU, the plain step ran 0.8x its
    # start-up price while drafting steps ran at theirs; the plan drafted
    # every step, a plain step of four requests never ran, so its price
    # never moved, and vLLM's plain decoding beat every drafting arm.  A
    # plain probe measures it, and the plan decodes plainly from then on.
    ctrl = SpecController(ControllerSettings(max_k=4), QWEN_CPU)
    k_steps = drive_true_prices(ctrl, 0.8, 4, 300, 0.8, np.random.default_rng(0))
    assert ctrl.stats.plain_probes == 1
    assert (k_steps[-150:] == 0).mean() >= 0.9
    assert ctrl.pricer.seconds(4, 4, 0) == pytest.approx(0.8 * QWEN_CPU.step(4, 4, 0), rel=0.05)
    # Without the probe the plan drafts on.
    monkeypatch.setattr(SpecController, "_plain_probe", lambda self, *a: None)
    ctrl = SpecController(ControllerSettings(max_k=4), QWEN_CPU)
    k_steps = drive_true_prices(ctrl, 0.8, 4, 300, 0.8, np.random.default_rng(0))
    assert (k_steps[-150:] > 0).mean() >= 0.9


def test_a_plain_probe_that_finds_drafting_pays_returns_to_it_and_waits():
    # The same start, but the profile's plain price is right: one probe of
    # the band, then drafting again, and no second probe before the band's
    # plain steps are forgotten.
    ctrl = SpecController(ControllerSettings(max_k=4), QWEN_CPU)
    k_steps = drive_true_prices(ctrl, 0.85, 4, 400, 1.0, np.random.default_rng(0))
    assert ctrl.stats.plain_probes == 1
    assert (k_steps[-200:] > 0).mean() >= 0.9


def test_the_start_up_check_seeds_the_correction_and_counts_as_plain_steps_seen():
    # A cached table checked at start: one request's plain step 1.23x the
    # table, drafting K=8 1.09x.  The correction starts there (not at 1.0,
    # learnt 2% a step), and one request's plain step counts as seen: no
    # plain probe of it on a cold server's first request.
    corr = ProfileCorrection()
    corr.seed([1], 3, plain=1.23, drafting=1.09)
    assert corr.ratio(9, 1) == pytest.approx(1.09)
    assert corr.ratio(1, 1, plain=True) == pytest.approx(1.23)
    assert corr.plain_seen(1) == 3 and corr.plain_seen(4) == 0
    profile = StepProfile.from_dict(QWEN_CPU.to_dict())
    profile.meta.update(start_check={
        "plain_batches": [1], "repeats": 3, "plain": 1.23, "drafting": 1.09})
    ctrl = SpecController(ControllerSettings(max_k=4), profile)
    assert ctrl.pricer.seconds(1, 1, 0) == pytest.approx(1.23 * profile.step(1, 1, 0))
    drive_true_prices(ctrl, 0.85, 1, 200, 1.23, np.random.default_rng(0))
    assert ctrl.stats.plain_probes == 0
    # The other batch sizes were not timed now: four requests are probed.
    drive_true_prices(ctrl, 0.85, 4, 100, 1.0, np.random.default_rng(1))
    assert ctrl.stats.plain_probes == 1
    # Not kept with the table: the next start checks again.
    assert "start_check" not in profile.to_dict()["meta"]
    # Without the live correction nothing is seeded: the table's own prices.
    fixed = SpecController(ControllerSettings(max_k=4, profile_correction=False), profile)
    assert fixed.pricer.seconds(1, 1, 0) == pytest.approx(profile.step(1, 1, 0))


def test_no_plain_probe_where_no_plain_run_could_overturn_the_plan():
    # Perfect drafts on a memory-bound profile: drafting's predicted gain is
    # far past what PLAIN_PROBE_STEPS steps could move a plain price.
    ctrl = SpecController(ControllerSettings(max_k=4), GPU_LIKE)
    drive_perfect_drafts(ctrl, 4, 200, np.random.default_rng(0))
    assert ctrl.stats.plain_probes == 0


def test_probe_timeout_counts_silent_probes_as_failures():
    # Probes whose drafts never reach verification (n-gram found nothing):
    # the controller must not wait for them forever; the back-off grows.
    settings = ControllerSettings(max_k=4)
    ctrl = SpecController(settings, MODERATE)
    ctrl.add_request("a")
    for _ in range(40):
        d = ctrl.plan(["a"])
        ctrl.observe_verifications(["a"], [d.k[0]], [0])  # fall back quickly
        if ctrl.num_in_fallback():
            break
    assert ctrl.num_in_fallback() == 1
    sent_at = []
    for step in range(300):
        d = ctrl.plan(["a"])
        if d.k[0] > 0:
            sent_at.append(step)
        ctrl.observe_step(1, 1, d.k_step, MODERATE.step(1, 1, d.k_step))  # no verification
    gaps = np.diff(sent_at)
    assert len(sent_at) >= 4 and gaps[-1] > gaps[0], sent_at
    assert (np.diff(gaps) >= 0).all(), gaps  # each silent probe doubled the back-off ...
    assert gaps.max() <= settings.probe_max_interval + ctrl.PROBE_TIMEOUT + 1  # ... up to its cap
    assert ctrl.stats.probes_succeeded == 0


def test_a_drafting_plan_with_fixed_k_step_grants_no_more_than_it():
    ctrl = SpecController(ControllerSettings(max_k=8), MODERATE)
    _, hist = drive(ctrl, [0.95, 0.02] * 4, 150, np.random.default_rng(8), fixed_k_step=3)
    assert all(d.k_step == 3 and d.k.max() <= 3 for d in hist)
    late = np.array([d.k for d in hist[-40:]])
    assert (late[:, 0::2] == 3).all() and late[:, 1::2].mean() < 0.3


def test_fixed_k_step_is_respected():
    ctrl = SpecController(ControllerSettings(max_k=4), MODERATE)
    drive(ctrl, [0.02, 0.95], 50, np.random.default_rng(8))
    for fixed in (4, 2, 1):
        d = ctrl.plan(["r0", "r1"], fixed_k_step=fixed)
        assert d.k_step == fixed and d.k.max() <= fixed
    d = ctrl.plan(["r0", "r1"], fixed_k_step=0)
    assert d.k_step == 0 and not d.k.any()
    # Pinned, a step without a slot worth it still runs the pinned K_step.
    ctrl = SpecController(ControllerSettings(max_k=4), MODERATE)
    for _ in range(30):
        d = ctrl.plan(["bad"], fixed_k_step=4)
        assert d.k_step == 4
        ctrl.observe_verifications(["bad"], d.k, [0])
    assert ctrl.plan(["bad"], fixed_k_step=4).k[0] <= 1


def test_per_request_k_differs_in_mixed_batch():
    ctrl = SpecController(ControllerSettings(max_k=8), MODERATE)
    _, hist = drive(ctrl, [0.95, 0.02] * 4, 200, np.random.default_rng(9))
    late = np.array([d.k for d in hist[-50:]])
    assert late[:, 0::2].min() >= 4
    assert late[:, 1::2].mean() < 0.3
    assert ctrl.num_in_fallback() == 4


@pytest.mark.parametrize("warm_up", [[3.0] * 4, [5.0] * 6, [43.0, 2.0]],
                         ids=["3x-first-4", "5x-first-6", "43x-2x"])
@pytest.mark.parametrize("seed", range(3))
def test_a_drafting_price_set_by_slow_warm_up_steps_does_not_keep_drafting_off(seed, warm_up):
    # A draft's first steps run new shapes and take several times their
    # steady time (3x for the tiny models behind vllm serve; 43x, then 2x,
    # at TP=2 on a CPU).  The old online regression priced drafting from
    # those steps: the request fell back, the probe gate asked the same
    # price and sent nothing, nothing drafted again, and so nothing
    # measured the price again.  The profile's price moves a correction
    # step per slow step at most, so the request keeps drafting and ends at
    # its ceiling.
    ctrl = SpecController(ControllerSettings(max_k=4), tiny_serve_profile())
    slow = list(warm_up)
    granted = drive_perfect_drafts(ctrl, 1, 240, np.random.default_rng(seed), warm_up=slow)
    assert granted[-32:] == [4] * 32, granted
    assert not slow  # every slow step ran
    corr = ctrl.pricer.correction
    # A few correction steps, not the slowdown: the level and each shape's ratio on it.
    assert corr._level + corr._log.max() <= corr.step * 4


POLICY_SETTINGS = [("goodput", None), ("static", 3), ("static", 9), ("heuristic", None)]


@pytest.mark.parametrize("policy,static_k", POLICY_SETTINGS)
def test_k_never_exceeds_ceilings_or_k_step(policy, static_k):
    # Random traffic: requests arriving and leaving, ceilings from 0 to
    # max_k (and changed mid-flight), per-plan caps (tokens left before
    # max_tokens), prefill chunks, pinned K_step now and then, catch-ups,
    # acceptance turning, timing noise and garbage.  Every policy holds
    # k[r] <= K_step <= max_k, a pinned K_step below its own K included.
    max_k = 6
    rng = np.random.default_rng(6)
    profiles = (GPU_LIKE, CPU_BOUND, tiny_serve_profile(), prior_profile("cuda", 0.05, 512, 64))
    for profile in profiles:
        ctrl = SpecController(ControllerSettings(max_k=max_k, policy=policy, static_k=static_k),
                              profile)
        live, ceilings, next_id, previous = {}, {}, 0, {}
        for step in range(250):
            while len(live) < 12 or rng.random() < 0.1:
                rid, next_id = f"r{next_id}", next_id + 1
                live[rid] = float(rng.uniform(0.0, 1.0))
                ceilings[rid] = int(rng.integers(0, max_k + 1)) if rng.random() < 0.7 else max_k
                ctrl.add_request(rid, None if ceilings[rid] == max_k else ceilings[rid])
            if step % 40 == 0:
                live = {r: 1.0 - a for r, a in live.items()}
            if rng.random() < 0.05:
                rid = str(rng.choice(list(live)))
                ceilings[rid] = int(rng.integers(0, max_k + 1))
                ctrl.set_ceiling(rid, ceilings[rid])
            ids = [r for r in live if rng.random() < 0.85] or list(live)[:1]
            fixed = int(rng.integers(0, max_k + 1)) if rng.random() < 0.2 else None
            base = len(ids) + (int(rng.choice([16, 256, 1024])) if rng.random() < 0.3 else 0)
            catchup = int(rng.integers(0, 300)) if rng.random() < 0.2 else 0
            caps = rng.integers(0, max_k + 1, size=len(ids)) if rng.random() < 0.2 else None
            d = ctrl.plan(ids, base_tokens=base, fixed_k_step=fixed, catchup_tokens=catchup,
                          tokens_left=None if caps is None else caps + 2)
            assert d.k.shape == (len(ids),) and d.k.dtype.kind == "i"
            assert 0 <= d.k_step <= max_k
            if fixed is not None:
                assert d.k_step == fixed
            for i, (r, k) in enumerate(zip(ids, d.k.tolist())):
                assert 0 <= k <= min(ceilings[r], d.k_step), (r, k, ceilings[r], d.k_step)
                # The static policy is vLLM's static K: no cap near max_tokens.
                assert caps is None or k <= caps[i] or policy == "static"
            verified = [previous.get(r, 0) for r in ids]
            accepted = [simulate_verification(rng, live[r], k) for r, k in zip(ids, verified)]
            ctrl.observe_verifications(ids, verified, accepted)
            tokens = base + sum(verified)
            seconds = profile.step(tokens, len(ids), d.k_step) * rng.lognormal(0.0, 0.2)
            if rng.random() < 0.03:
                seconds = float(rng.choice([float("nan"), -1.0, 1e6]))
            ctrl.observe_step(len(ids), tokens, d.k_step, seconds)
            previous = dict(zip(ids, d.k.tolist()))
            for r in list(live):
                if rng.random() < 0.03:
                    del live[r]
                    ctrl.finish_request(r)
        s = ctrl.stats
        assert int(s.k_counts.sum()) == s.request_steps
        assert s.granted_slots <= s.request_steps * max_k


def test_ceiling_zero_never_drafts_or_probes():
    ctrl = SpecController(ControllerSettings(max_k=4), MODERATE)
    ctrl.add_request("off", ceiling=0)
    ctrl.add_request("bad")
    rng = np.random.default_rng(7)
    previous = np.zeros(2, dtype=np.int64)
    for _ in range(150):
        d = ctrl.plan(["off", "bad"])
        assert d.k[0] == 0
        ctrl.observe_verifications(["off", "bad"], previous,
                                   [0, simulate_verification(rng, 0.02, previous[1])])
        previous = d.k.copy()
    sent = ctrl.stats.probes_sent
    assert sent > 0  # "bad" was probed, "off" never
    assert ctrl.num_in_fallback() == 1  # a ceiling of 0 is not fallback
    for _ in range(100):
        d = ctrl.plan(["off"])
        assert d.k_step == 0 and d.k[0] == 0
    assert ctrl.stats.probes_sent == sent
    # A ceiling lowered to 0 mid-flight turns a drafting request off.
    ctrl.add_request("good")
    for _ in range(20):
        ctrl.observe_verifications(["good"], [4], [4])
    assert ctrl.plan(["good"]).k[0] == 4
    ctrl.set_ceiling("good", 0)
    for _ in range(50):
        d = ctrl.plan(["good"])
        assert d.k_step == 0 and d.k[0] == 0
    assert ctrl.stats.probes_sent == sent


def test_max_k_zero_never_drafts():
    ctrl = SpecController(ControllerSettings(max_k=0), GPU_LIKE)
    for _ in range(50):
        d = ctrl.plan(["a", "b"])
        assert d.k_step == 0 and not d.k.any()
    assert ctrl.stats.probes_sent == 0
    with pytest.raises(ValueError):
        SpecController(ControllerSettings(max_k=-1))


def test_static_and_heuristic_policies():
    static = SpecController(ControllerSettings(max_k=8, policy="static", static_k=3))
    static.add_request("a", ceiling=2)
    static.add_request("b")
    d = static.plan(["a", "b"])
    assert d.k.tolist() == [2, 3] and d.k_step == 3
    assert static.plan(["a", "b"], fixed_k_step=5).k_step == 5

    heur = SpecController(ControllerSettings(max_k=8, policy="heuristic"))
    heur.add_request("a")
    assert heur.plan(["a"]).k[0] == 8
    heur.observe_verification("a", 8, 2)
    assert heur.plan(["a"]).k[0] == 7
    heur.observe_verification("a", 7, 7)
    assert heur.plan(["a"]).k[0] == 8
    for _ in range(20):
        heur.observe_verification("a", 5, 0)
    assert heur.plan(["a"]).k[0] == 1
    heur.add_request("b", ceiling=3)
    d = heur.plan(["a", "b"])
    assert d.k.tolist() == [1, 3] and d.k_step == 3
    assert heur.stats.probes_sent == 0


def test_finished_requests_free_state():
    ctrl = SpecController(ControllerSettings(max_k=4), MODERATE)
    ids, _ = drive(ctrl, [0.02] * 5, 60, np.random.default_rng(10))
    assert ctrl.num_in_fallback() == 5 and ctrl.stats.probes_sent > 0
    old_rows = [ctrl.estimator.row(r) for r in ids]
    for r in ids:
        ctrl.finish_request(r)
    assert ctrl.num_requests() == 0 and len(ctrl.estimator) == 0
    assert ctrl.num_in_fallback() == 0
    ctrl.finish_request("never-seen")  # harmless
    # Observations of finished requests are ignored.
    ctrl.observe_verifications(ids, [4] * 5, [4] * 5)
    assert ctrl.num_requests() == 0
    # A new request in a freed row starts fresh: the configured ceiling, no
    # probe history, no fallback, no acceptance history of its own (only
    # the pool's): the same state as a new request in a row never used.
    ctrl.add_request("new", ceiling=3)
    row = ctrl.estimator.row("new")
    assert row in old_rows
    for i in range(len(ids)):
        ctrl.add_request(f"fresh{i}", ceiling=3)
    fresh = ctrl.estimator.row(f"fresh{len(ids) - 1}")
    assert fresh not in old_rows
    for name in ("_ceiling", "_backoff", "_waited", "_probe_at", "_probe_size", "_probe_ok",
                 "_in_fallback"):
        assert getattr(ctrl, name)[row] == getattr(ctrl, name)[fresh], name
    assert ctrl._ceiling[row] == 3 and ctrl._in_fallback[row] == 0
    assert ctrl.estimator._trials[row].sum() == 0
    assert np.allclose(ctrl.estimator.survival(np.array([row])),
                       ctrl.estimator.survival(np.array([fresh])), atol=1e-9)


# -- the goodput policy: one decision --------------------------------------------------

def plan_seconds(pricer, batch, base, k_step, n, width):
    """Decode seconds of a plan as the policy defines them (its docstring).

    Plain decoding (K_step = 0): the plain step of the decoding requests, at
    the correction of the step's size.  A plan that runs ``k_step`` draft
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
        return corr.ratio(base, batch) * profile.step(batch, batch, 0)
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
    return corr.ratio(tokens, batch) * raw


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
    Prices as ``plan_seconds`` plus ``owed_per_token`` for each token of a
    drafting plan, and plain decoding plus ``skip`` spread over ``horizon``
    for each of its tokens, one scalar lookup at a time.
    """
    batch, width = survival.shape
    owed = owed_per_token(pricer, batch, base, catch_up, horizon)
    plain_owed = skip / max(horizon, 1.0) if horizon is not None and fixed_k_step is None else 0.0
    js = [fixed_k_step] if fixed_k_step is not None else range(width + 1)
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
