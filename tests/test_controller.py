"""Unit tests of the controller: no vLLM, milliseconds each."""

import math

import numpy as np
import pytest

from vllm_specplug.controller import (
    AcceptanceEstimator,
    ControllerSettings,
    CostPrior,
    GoodputPolicy,
    SpecController,
    StepCostModel,
)


def simulate_verification(rng, alpha, drafted):
    accepted = 0
    while accepted < drafted and rng.random() < alpha:
        accepted += 1
    return accepted


def true_step_seconds(batch, tokens, k_step, per_token=0.01, draft=0.0):
    return 0.05 + 0.002 * batch + per_token * tokens + draft * k_step * (1 + 0.1 * batch)


def drive(ctrl, alphas, steps, rng, per_token=0.01, draft=0.0, req_prefix="r"):
    """Run ``steps`` steps for requests with the given true acceptance rates.

    Keeps vLLM's pipeline: the drafts planned at step t are proposed at the
    end of step t and verified in step t+1, so the controller sees their
    outcome only after it has planned step t+1.
    """
    ids = [f"{req_prefix}{i}" for i in range(len(alphas))]
    for r in ids:
        ctrl.add_request(r)
    history = []
    previous = None
    for _ in range(steps):
        d = ctrl.plan(ids)
        verified = previous.k if previous is not None else np.zeros(len(ids), dtype=int)
        tokens = len(ids) + int(verified.sum())
        ctrl.observe_verifications(
            ids, verified, [simulate_verification(rng, a, k) for a, k in zip(alphas, verified)])
        ctrl.observe_step(len(ids), tokens, d.k_step,
                          true_step_seconds(len(ids), tokens, d.k_step, per_token, draft))
        history.append(d)
        previous = d
    return ids, history


def drive_perfect_drafts(ctrl, batch, steps, rng, step_seconds, warm_up=(), catch_up=None):
    """Run ``steps`` steps of ``batch`` requests whose drafts are always accepted.

    Returns the k granted to the first request, step by step.  Step time is
    ``step_seconds(tokens, k_step)`` with 10% lognormal noise; the first
    drafting steps are multiplied by ``warm_up`` (a draft's first steps run
    new shapes).  With ``catch_up`` (seconds for a catch-up of n tokens),
    zero-cost fallback: the draft skips K=0 steps and catches up on their
    tokens in the next step that drafts.
    """
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        ctrl.add_request(r)
    warm_up = list(warm_up)
    previous, gap, granted = np.zeros(batch, dtype=int), 0, []
    for _ in range(steps):
        d = ctrl.plan(ids, catchup_tokens=gap)
        ctrl.observe_verifications(ids, previous, previous)
        tokens = batch + int(previous.sum())
        catchup = gap if d.k_step else 0
        seconds = step_seconds(tokens, d.k_step)
        if catchup:
            seconds += catch_up(catchup)
        if d.k_step and warm_up:
            seconds *= warm_up.pop(0)
        ctrl.observe_step(batch, tokens, d.k_step, seconds * rng.lognormal(0.0, 0.1), catchup)
        if catch_up is not None:
            gap = 0 if d.k_step else gap + tokens
        previous = d.k.copy()
        granted.append(int(d.k[0]))
    return granted


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


def test_cost_model_learns_linear_costs_and_ignores_garbage():
    cm = StepCostModel(CostPrior.for_platform("cpu", "model", 0.3))
    rng = np.random.default_rng(1)
    for _ in range(300):
        b = int(rng.integers(1, 32))
        k = int(rng.integers(0, 8))
        t = b * (1 + int(rng.integers(0, k + 1)))
        cm.observe(b, t, k, true_step_seconds(b, t, k, draft=0.01) * rng.uniform(0.97, 1.03))
    for garbage in (0.0, -1.0, float("nan"), float("inf")):
        assert cm.observe(8, 8, 0, garbage) is False
    cm.observe(8, 8, 0, 1e6)  # huge outlier is clipped, not trusted
    for b, t, k in [(1, 1, 0), (8, 40, 4), (16, 16, 8)]:
        assert cm.predict(b, t, k) == pytest.approx(true_step_seconds(b, t, k, draft=0.01), rel=0.15)


def test_goodput_speculates_when_drafts_are_good():
    ctrl = SpecController(ControllerSettings(max_k=8))
    _, hist = drive(ctrl, [0.95], 200, np.random.default_rng(2))
    assert np.mean([d.k[0] for d in hist[-50:]]) >= 5


def test_goodput_falls_back_when_drafts_are_bad():
    ctrl = SpecController(ControllerSettings(max_k=8))
    _, hist = drive(ctrl, [0.02], 200, np.random.default_rng(3))
    late = [d.k[0] for d in hist[-100:]]
    # Only sparse probes of one token remain.
    assert np.mean(late) < 0.15 and max(late) <= 1
    first_zero = next(i for i, d in enumerate(hist) if d.k[0] == 0)
    assert first_zero < 20


def test_goodput_falls_back_when_compute_bound():
    # Verification tokens cost as much as a decode step each: even good
    # drafts (alpha=0.7) do not pay at a large batch.
    ctrl = SpecController(ControllerSettings(max_k=8))
    _, hist = drive(ctrl, [0.7] * 64, 150, np.random.default_rng(4), per_token=0.05)
    assert np.mean([d.k.mean() for d in hist[-50:]]) < 0.1


def test_goodput_recovers_after_regime_change():
    ctrl = SpecController(ControllerSettings(max_k=8))
    rng = np.random.default_rng(5)
    drive(ctrl, [0.02], 150, rng)
    _, hist = drive(ctrl, [0.97], 150, rng)
    recovered_at = next(i for i, d in enumerate(hist) if d.k[0] >= 3)
    assert recovered_at < 64
    assert np.mean([d.k[0] for d in hist[-30:]]) >= 4
    assert ctrl.stats.recoveries >= 1 and ctrl.stats.probes_succeeded >= 1


def test_probes_pay_for_a_shared_draft_pass_and_bring_a_batch_back():
    # A draft pass costs about two verified tokens: one probe alone could
    # never pay for switching the proposer on, but a batch whose drafts turn
    # good again would.  Probes must go out, succeed, and restore K.
    ctrl = SpecController(ControllerSettings(max_k=4))
    rng = np.random.default_rng(11)
    _, hist = drive(ctrl, [0.02] * 8, 120, rng, draft=0.01)
    assert np.mean([d.k.mean() for d in hist[-40:]]) < 0.2
    sent = ctrl.stats.probes_sent
    assert sent > 0
    _, hist = drive(ctrl, [0.97] * 8, 150, rng, draft=0.01)
    assert ctrl.stats.probes_succeeded >= 1
    assert np.mean([d.k.mean() for d in hist[-30:]]) >= 3


@pytest.mark.parametrize("seed", range(12))
def test_the_first_drafting_steps_warm_up_without_trapping_the_request_in_fallback(seed):
    # Measured at TP=2 on a CPU, target as its own draft: a plain step 2 ms,
    # a draft pass 0.5 ms, the first step that drafts 43x a plain step, the
    # second 2x.  Fitted, the second priced the draft pass at 6x its value;
    # the requests fell back, nothing drafted again, so nothing re-measured
    # the price, and the probe gate (which asks it) kept every probe back.
    ctrl = SpecController(ControllerSettings(max_k=4), CostPrior.for_platform("cpu", "model", 1.0))
    drafted = drive_perfect_drafts(ctrl, 4, 96, np.random.default_rng(seed),
                                   lambda tokens, k_step: 2e-3 + 4e-5 * tokens + 5e-4 * k_step,
                                   warm_up=[43.0, 2.0])
    assert max(drafted) == 4 and np.mean(drafted[-16:]) >= 3.5, drafted


def test_probe_timeout_counts_silent_probes_as_failures():
    # Probes whose drafts never reach verification (n-gram found nothing):
    # the controller must not wait for them forever; back-off grows.
    ctrl = SpecController(ControllerSettings(max_k=4))
    ctrl.add_request("a")
    for _ in range(40):
        d = ctrl.plan(["a"])
        ctrl.observe_verifications(["a"], [d.k[0]], [0])  # fall back quickly
        if ctrl.num_in_fallback():  # (not a plain anchor's k=0)
            break
    sent_at = []
    for step in range(300):
        d = ctrl.plan(["a"])
        if d.k[0] > 0:
            sent_at.append(step)
        ctrl.observe_step(1, 1, d.k_step, 0.1)  # no verification ever arrives
    gaps = np.diff(sent_at)
    assert len(sent_at) >= 4 and gaps[-1] > gaps[0]
    assert gaps.max() <= ControllerSettings(max_k=4).probe_max_interval + ctrl.PROBE_TIMEOUT + 1


def test_k_never_exceeds_ceilings_or_k_step():
    ctrl = SpecController(ControllerSettings(max_k=6))
    ids = [f"r{i}" for i in range(10)]
    for i, r in enumerate(ids):
        ctrl.add_request(r, ceiling=i % 4)
    rng = np.random.default_rng(6)
    for _ in range(100):
        d = ctrl.plan(ids)
        assert d.k_step <= 6
        for i, k in enumerate(d.k.tolist()):
            assert 0 <= k <= min(i % 4, d.k_step)
        for r, k in zip(ids, d.k.tolist()):
            ctrl.observe_verification(r, k, simulate_verification(rng, 0.9, k))
        ctrl.observe_step(10, 10 + int(d.k.sum()), d.k_step, 0.1 + 0.001 * d.k.sum())


def test_ceiling_zero_never_drafts_or_probes():
    ctrl = SpecController(ControllerSettings(max_k=4))
    ctrl.add_request("off", ceiling=0)
    _, hist = drive(ctrl, [0.01], 100, np.random.default_rng(7))
    d = ctrl.plan(["off"])
    assert d.k[0] == 0 and ctrl.stats.probes_sent > 0
    for _ in range(50):
        assert ctrl.plan(["off"]).k[0] == 0


def test_fixed_k_step_is_respected():
    ctrl = SpecController(ControllerSettings(max_k=4))
    _, hist = drive(ctrl, [0.02, 0.95], 50, np.random.default_rng(8))
    d = ctrl.plan(["r0", "r1"], fixed_k_step=4)
    assert d.k_step == 4


def test_per_request_k_differs_in_mixed_batch():
    ctrl = SpecController(ControllerSettings(max_k=8))
    _, hist = drive(ctrl, [0.95, 0.02] * 4, 200, np.random.default_rng(9))
    late = np.array([d.k for d in hist[-50:]])
    assert late[:, 0::2].mean() >= 4
    assert late[:, 1::2].mean() < 0.3


def test_static_and_heuristic_policies():
    static = SpecController(ControllerSettings(max_k=8, policy="static", static_k=3))
    static.add_request("a", ceiling=2)
    static.add_request("b")
    d = static.plan(["a", "b"])
    assert d.k.tolist() == [2, 3] and d.k_step == 3

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


def test_finished_requests_free_state():
    ctrl = SpecController(ControllerSettings(max_k=4))
    ids, _ = drive(ctrl, [0.5] * 5, 10, np.random.default_rng(10))
    for r in ids:
        ctrl.finish_request(r)
    assert ctrl.num_requests() == 0 and len(ctrl.estimator) == 0


def test_goodput_policy_direct_threshold():
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.1))
    for _ in range(StepCostModel.SKIP_FIRST + 1):
        cm.observe(1, 1, 0, 1.1)  # calibrates the scale: step = 1.1 s
    pol = GoodputPolicy(min_gain=0.0)
    survival = np.array([[0.9, 0.81, 0.73, 0.66], [0.05, 0.0025, 0.0, 0.0]])
    d = pol.decide(survival, np.array([4, 4]), 2.0, cm)
    assert d.k[0] >= 3 and d.k[1] == 0 and d.k_step == d.k.max()
    assert d.predicted_speedup > 1.0


def test_ceilings_hold_when_verification_looks_free():
    # A fit can clamp the per-token cost to 0; slots above a ceiling (and
    # ceiling-0 requests) must still get nothing.
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.0))
    for _ in range(StepCostModel.SKIP_FIRST + 1):
        cm.observe(2, 2, 0, 1.0)
    d = GoodputPolicy(min_gain=0.0).decide(
        np.array([[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.7, 0.6]]), np.array([0, 2]), 2.0, cm)
    assert d.k[0] == 0 and d.k[1] <= 2


def test_catch_up_cost_is_learned_from_the_excess_and_priced_into_plans():
    # Steps cost 1 s + 0.1 s/token; a draft catch-up adds 0.01 s per token.
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.1,
                                 per_catchup_token=0.001))
    for _ in range(StepCostModel.SKIP_FIRST + 40):
        cm.observe(2, 2, 0, 1.2)
        cm.observe(2, 6, 2, 1.6)
        cm.observe(2, 2, 1, 1.3)
    for _ in range(12):
        cm.observe(2, 2, 1, 1.3 + 0.01 * 200, catchup=200)
    assert cm.catchup_seconds(200) == pytest.approx(2.0, rel=0.15)
    # The catch-up steps did not distort the step model.
    assert cm.predict(2, 2, 0) == pytest.approx(1.2, rel=0.05)
    pol = GoodputPolicy(min_gain=0.0)
    good = np.array([[0.9, 0.81, 0.73, 0.66], [0.9, 0.81, 0.73, 0.66]])
    ceilings = np.array([4, 4])
    assert pol.decide(good, ceilings, 2.0, cm).k_step > 0
    # A catch-up of thousands of tokens is not worth one batch's good drafts.
    d = pol.decide(good, ceilings, 2.0, cm, catchup_tokens=5000)
    assert d.k_step == 0 and not d.k.any()
    # A modest one is: it costs less than the skipped draft passes would have.
    d = pol.decide(good, ceilings, 2.0, cm, catchup_tokens=20)
    assert d.k_step > 0
    assert d.predicted_seconds > pol.decide(good, ceilings, 2.0, cm).predicted_seconds


def every_plan(survival, a0, a_tok, a_pass, knee=np.inf, knee_slope=0.0, base=None,
               pass_offset=0):
    """(expected tokens, step seconds) of every plan a threshold policy could choose.

    For each K_step j, the slots worth taking are the most likely ones among
    positions < j; the best set is a top-n of them for some n, so every n of
    every j (plain decoding first) covers the optimum of any objective that
    prefers likelier slots.  ``base``: the step's tokens besides drafts (one
    per request by default); ``pass_offset``: draft passes a K_step = 0 step
    runs anyway (``StepCostModel.pass_offset``).
    """
    batch, width = survival.shape
    base = batch if base is None else base

    def seconds(n, j):
        return (a0 + a_tok * (base + n) + a_pass * max(j - pass_offset, 0)
                + knee_slope * np.maximum(base + n - knee, 0))

    tokens, secs = [np.array([float(batch)])], [np.array([seconds(0, 0)])]
    for j in range(1, width + 1):
        values = np.sort(survival[:, :j].ravel())[::-1]
        tokens.append(batch + np.cumsum(values))
        secs.append(seconds(np.arange(1, values.size + 1), j))
    return np.concatenate(tokens), np.concatenate(secs)


def best_rate_by_enumeration(survival, a0, a_tok, a_pass, knee=np.inf, knee_slope=0.0):
    """The best decode rate (tokens / seconds) over every plan (``every_plan``)."""
    tokens, seconds = every_plan(survival, a0, a_tok, a_pass, knee, knee_slope)
    return (tokens / seconds).max()


@pytest.mark.parametrize("seed", range(6))
def test_goodput_plan_is_near_the_best_rate_and_consistent(seed):
    # The policy finds its plan in a few Dinkelbach rounds, not by search;
    # it must come within a fraction of a percent of the enumerated optimum,
    # and its k must be exactly the slots its threshold selects.
    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 96)), int(rng.integers(1, 9))
    per_token, per_pass = rng.uniform(0.001, 0.3), rng.uniform(0.0, 0.3)
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=per_token,
                                 per_draft_pass=per_pass))  # uncalibrated: point estimates
    alpha = rng.uniform(0.05, 1.0, size=(batch, width))
    survival = np.cumprod(alpha, axis=1)
    d = GoodputPolicy(min_gain=0.0).decide(survival, np.full(batch, width), float(batch), cm)
    a0, a_tok, a_pass = cm.linear_terms(batch)
    rate = d.predicted_tokens / d.predicted_seconds
    assert rate >= 0.995 * best_rate_by_enumeration(survival, a0, a_tok, a_pass)
    if d.k_step:
        granted = survival[:, : d.k_step] >= np.sort(
            survival[:, : d.k_step].ravel())[::-1][d.k.sum() - 1]
        assert (granted.sum(axis=1) == d.k).all()
    expected = len(d.k) + sum(survival[r, : d.k[r]].sum() for r in range(batch))
    assert d.predicted_tokens == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(8))
def test_goodput_plan_is_near_the_best_rate_with_a_cost_knee(seed):
    # Past the cost model's knee (a GPU's roofline ridge) a token costs more:
    # the plan fills the step up to the knee with the slots worth the lower
    # price, then takes only those worth the higher one.
    rng = np.random.default_rng(100 + seed)
    batch, width = int(rng.integers(2, 96)), int(rng.integers(1, 9))
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0,
                                 per_token=rng.uniform(0.0005, 0.01),
                                 per_draft_pass=rng.uniform(0.0, 0.2)))
    cm.knee = float(batch + rng.integers(0, batch * width))
    cm.knee_slope = float(rng.uniform(0.01, 0.2))
    survival = np.cumprod(rng.uniform(0.3, 1.0, size=(batch, width)), axis=1)
    d = GoodputPolicy(min_gain=0.0).decide(survival, np.full(batch, width), float(batch), cm)
    a0, a_tok, a_pass = cm.linear_terms(batch)
    best = best_rate_by_enumeration(survival, a0, a_tok, a_pass, cm.knee, cm.knee_slope)
    assert d.predicted_tokens / d.predicted_seconds >= 0.99 * best
    expected = len(d.k) + sum(survival[r, : d.k[r]].sum() for r in range(batch))
    assert d.predicted_tokens == pytest.approx(expected)


@pytest.mark.parametrize("alpha", [0.7, 0.8, 0.9])
def test_a_prefill_step_past_the_knee_values_time_at_the_decode_only_rate(alpha):
    # Like the simulated 70B + 1B at c=64: a decode-only step sits below the
    # roofline's knee, and a 512-token prefill chunk takes a step past it,
    # where each draft costs the price past the knee.  In a closed loop a
    # request brings one such step whatever is drafted, so time per output
    # token is (1 - g_P / L) * t_D / g_D + t_P / L for a request of L tokens
    # (decode-only steps: g_D tokens in t_D; the prefill step: g_P in t_P).
    # The prefill step's plan must minimise that.  Judged at its own rate the
    # step drafted at K_step 2, 3 and 5 here where the optimum drafts 1, 1
    # and 2: 3-6% more time per token at L = 64.  (tests/test_sim.py's 70B +
    # 1B easy at c=64 went from 0.951 to 0.972 of static K=2.)
    batch, width, chunk = 64, 8, 512
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.0005,
                                 per_draft_pass=0.035, draft_runs_at_k0=True))
    cm.knee, cm.knee_slope = 181.0, 0.0045  # a token past it costs 0.5% of a step
    rng = np.random.default_rng(3)
    survival = np.cumprod(rng.uniform(alpha - 0.05, alpha + 0.05, size=(batch, width)), axis=1)
    ceilings = np.full(batch, width)
    # Every plan of the prefill step, its seconds the whole step's.
    plan_tokens, plan_seconds = every_plan(survival, *cm.linear_terms(batch), cm.knee,
                                           cm.knee_slope, base=batch + chunk,
                                           pass_offset=cm.pass_offset)
    for use_compiled in (True, False):
        pol = GoodputPolicy(use_compiled=use_compiled)
        dec = pol.decide(survival, ceilings, float(batch), cm)
        pre = pol.decide(survival, ceilings, float(batch + chunk), cm)
        for length in (64, 256, 1024):
            def seconds_per_token(g_p, t_p):
                return ((1 - g_p / length) * dec.predicted_seconds / dec.predicted_tokens
                        + t_p / length)
            best = seconds_per_token(plan_tokens, plan_seconds).min()
            assert seconds_per_token(pre.predicted_tokens, pre.predicted_seconds) <= 1.001 * best


def test_cost_model_finds_a_roofline_knee_and_stays_linear_without_one():
    rng = np.random.default_rng(5)

    def fit(step_seconds):
        cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.02))
        for _ in range(300):
            batch = int(rng.integers(8, 65))
            k_step = int(rng.integers(0, 5))
            tokens = batch * (1 + k_step) + int(rng.choice([0, 0, 0, 256]))  # some prefill
            cm.observe(batch, tokens, k_step,
                       step_seconds(tokens, k_step) * rng.lognormal(0, 0.03))
        return cm

    # Memory-bound (flat) up to a ridge at 150 tokens, compute-bound past it.
    roofline = fit(lambda t, k: 0.002 + max(0.010, 0.010 * t / 150) + 0.0003 * k)
    assert roofline.knee is not None and 150 / 1.5 <= roofline.knee <= 150 * 1.5
    for tokens in (40, 120, 200, 400):
        truth = 0.002 + max(0.010, 0.010 * tokens / 150) + 0.0003
        assert roofline.predict(32, tokens, 1) == pytest.approx(truth, rel=0.1)
    # A CPU: compute-bound from the first token, one slope: no knee.
    linear = fit(lambda t, k: 0.05 + 0.004 * t + 0.01 * k)
    assert linear.knee is None


def test_a_first_draft_pass_run_at_k0_is_not_charged_to_one_draft():
    # vLLM runs a draft model's (or EAGLE head's) first pass every step, at
    # K_step = 0 too, to keep the draft's KV cache in sync: one draft per
    # request costs only its verification, each further position a pass.
    # A model linear in K_step fits a pass's price between K=0 and the
    # longer drafts and charges most of it to K=1, and the policy then falls
    # back where one draft per request still pays (the simulator's 8B/EAGLE
    # at c=256: 0.94-0.96 of plain, 1.00 after).
    batch, first, later = 64, 0.004, 0.004

    def truth(tokens, k_step):  # memory-bound: verifying is nearly free
        return 0.010 + 1e-5 * tokens + first + later * max(k_step - 1, 0)

    def fit(runs_at_k0):
        rng = np.random.default_rng(11)
        cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.1,
                                                  draft_runs_at_k0=runs_at_k0))
        for _ in range(200):
            k_step = int(rng.choice([0, 0, 2, 3, 4]))  # never K=1: it must be inferred
            tokens = batch + int(rng.integers(0, batch * k_step + 1))
            cm.observe(batch, tokens, k_step, truth(tokens, k_step) * rng.lognormal(0, 0.02))
        return cm

    survival = np.tile(np.cumprod([0.2, 0.2, 0.2, 0.2]), (batch, 1))
    ceilings = np.full(batch, 4)
    right, linear = fit(True), fit(False)
    for k_step in range(5):
        tokens = batch * (1 + k_step)
        assert right.predict(batch, tokens, k_step) == pytest.approx(truth(tokens, k_step),
                                                                      rel=0.05)
    assert right.draft_passes(0) == right.draft_passes(1) == 0
    assert linear.predict(batch, 2 * batch, 1) > 1.1 * truth(2 * batch, 1)
    for use_compiled in (True, False):
        pol = GoodputPolicy(use_compiled=use_compiled)
        good = pol.decide(survival, ceilings, float(batch), right)
        assert good.k_step == 1 and good.k.tolist() == [1] * batch
        assert pol.decide(survival, ceilings, float(batch), linear).k_step == 0


def _run_with_slow_first_drafting_steps(seed: int, steps: int) -> list[int]:
    """k granted to one request whose drafts are always accepted, step by step.

    The tiny test models behind vllm serve (test_server): the target as its
    own draft, zero-cost fallback (the draft skips K=0 steps and catches
    up), a plain step 2.7 ms, a draft pass 0.75 ms, and a draft's first
    steps 3x their steady time.  Two are dropped as warm-up
    (StepCostModel.SKIP_FIRST_DRAFTING); here two more are slow.
    """
    ctrl = SpecController(ControllerSettings(max_k=4, cost_forgetting=0.99),
                          CostPrior.for_platform("cpu", "model", 1.0))
    return drive_perfect_drafts(
        ctrl, 1, steps, np.random.default_rng(seed),
        lambda tokens, k_step: 2.5e-3 + 1.6e-4 * tokens + 7.5e-4 * k_step,
        warm_up=[3.0] * 4, catch_up=lambda n: 7.5e-4 + 5e-5 * n)


@pytest.mark.xfail(strict=True, reason=(
    "known cold-start trap (benchmarks/README.md, Cold start): a drafting price set by a "
    "few slow warm-up steps is never measured again"))
@pytest.mark.parametrize("seed", range(3))
def test_a_drafting_price_set_by_slow_warm_up_steps_does_not_keep_drafting_off(seed):
    # Fitted, the two slow steps price drafting at several plain steps: the
    # request falls back at once, and the probe gate, which asks the same
    # price (plus the catch-up the probe would trigger), sends no probe.
    # Nothing drafts, so nothing measures the price again.  Each re-measure
    # tried in session 18 either kept this trap or took a cell of the
    # simulated CPU profile below 0.97x of plain (benchmarks/README.md, "The
    # same trap behind vllm serve"); the cap on drafts near max_tokens
    # (session 16) stays out until a fix does neither.  Strict: a fix makes
    # this pass and must then drop the mark.
    granted = _run_with_slow_first_drafting_steps(seed, 240)
    assert 0 in granted[:120]  # the slow steps did put the request in fallback
    assert np.mean(granted[-32:]) >= 3.5, granted


def test_a_plan_that_makes_the_draft_catch_up_is_not_tried_just_to_measure_it():
    # The cost bound's optimism gets untried plans measured once.  With
    # zero-cost fallback a plan that drafts first makes the draft catch up
    # on every token it skipped (on the CPU profile, the time of 10-20 plain
    # steps), so there plans are judged at the point estimate.
    cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.1,
                                 per_draft_pass=0.3))
    rng = np.random.default_rng(0)
    for _ in range(40):  # plain steps only: the draft pass's price is unmeasured
        tokens = 4 + int(rng.choice([0, 0, 32]))
        cm.observe(4, tokens, 0, (0.5 + 0.1 * tokens) * rng.lognormal(0, 0.05))
    survival = np.tile(np.cumprod([0.55] * 4), (4, 1))
    ceilings = np.full(4, 4)
    for use_compiled in (True, False):
        pol = GoodputPolicy(use_compiled=use_compiled)
        assert pol.decide(survival, ceilings, 4.0, cm).k_step > 0
        assert pol.decide(survival, ceilings, 4.0, cm, explore=False).k_step == 0
    # The controller explores when no catch-up is pending, and before the
    # draft's price is measured (a fresh engine judged at its prior may
    # never draft: test_scaling_server's perfect draft did not).
    ctrl = SpecController(ControllerSettings(max_k=4))
    seen = []
    decide = ctrl.goodput.decide
    ctrl.goodput.decide = lambda *a, **kw: seen.append(kw["explore"]) or decide(*a, **kw)
    ctrl.add_request("r")
    ctrl.plan(["r"], catchup_tokens=64)
    for k_step in (0, 0, 2, 2, 2, 2, 2, 2):  # two engine steps, two drafting ones unfitted
        ctrl.observe_step(1, 1 + k_step, k_step, 0.01 * (1 + k_step))
    assert ctrl.cost.num_drafting_observations == ctrl.EXPLORE_DRAFTING_STEPS
    ctrl.plan(["r"])
    ctrl.plan(["r"], catchup_tokens=64)
    assert seen == [True, True, False]


def test_optimism_never_prices_a_drafting_step_below_a_plain_one():
    # The cost bound's optimism (untried plans look cheaper, so they get
    # measured) never puts a plan below halfway from a plain step to the
    # plan's point estimate: the plan does a plain step's work and more, and
    # the policy compares it with a plain step at its point estimate.
    # test_server's bad draft (accepted 3% of the time, tiny models on a
    # CPU) was drafted for in 131 of 192 request-steps in CI.  A trace of it
    # here: a new request's 14-token prefill, priced at 2.7x what it took,
    # raised the residual scale from 0.07 ms to 1.2 ms; the old floor, half
    # the plan's own estimate, put a one-draft step 30% below a plain one,
    # and after a lucky probe the draft ran step after step.
    cost = StepCostModel(CostPrior.for_platform("cpu", "model", 0.58), forgetting=0.99)
    rng = np.random.default_rng(0)
    cost.observe(1, 14, 1, 0.026)  # the engine's first steps (not fitted)
    cost.observe(1, 2, 1, 0.006)
    for i in range(56):  # plain steps; every eighth verifies a failed probe's draft
        two = i % 8 == 0
        cost.observe(1, 2 if two else 1, 0,
                     (1.6e-3 if two else 1.3e-3) * (1.0 + 0.05 * rng.standard_normal()))
    cost.observe(1, 14, 0, 2.0e-3)  # the next request's prefill
    plain = cost.predict(1, 1, 0)
    assert cost.predict(1, 14, 0) > 2.0e-3 and math.sqrt(cost._resid_var) > 0.5 * plain
    lower = cost.predict_lower(1, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], optimism=1.0)
    points = cost.predict_lower(1, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    assert lower[0] == pytest.approx(plain)
    for low, point in zip(lower[1:], points[1:]):
        assert plain < low <= point
        assert low - plain >= 0.5 * (point - plain) - 1e-12
    survival = np.array([[0.08, 0.006, 0.0005, 0.0]])  # a bad draft after a lucky probe
    for use_compiled in (True, False):
        decision = GoodputPolicy(use_compiled=use_compiled).decide(
            survival, np.array([4]), 1.0, cost)
        assert decision.k_step == 0


def test_compiled_policy_loop_matches_the_numpy_path():
    # vllm_specplug.controller.compiled (numba, which comes with vLLM) and the
    # NumPy path must make the same decisions: fixed and free K_step, capped
    # ceilings, catch-up charges, calibrated (optimistic bounds) or not.
    from vllm_specplug.controller import compiled

    pytest.importorskip("numba")
    assert compiled.best_plan is not None, "numba is installed but the loop did not compile"
    rng = np.random.default_rng(7)
    checked = knee_bound = 0
    for trial in range(300):
        batch, width = int(rng.integers(1, 80)), int(rng.integers(1, 9))
        cm = StepCostModel(CostPrior(intercept=1.0, per_request=rng.uniform(0, 0.05),
                                     per_token=rng.uniform(0.001, 0.3),
                                     per_draft_pass=rng.uniform(0, 0.3),
                                     draft_runs_at_k0=trial % 4 >= 2))
        if trial % 2:  # calibrate: lower confidence bounds come into play
            for i in range(30):
                t = batch + int(rng.integers(0, batch * width + 1))
                ks = int(rng.integers(0, width + 1))
                cm.observe(batch, t, ks, (1 + 0.05 * t + 0.1 * ks) * rng.lognormal(0, 0.1))
        if trial % 3 == 1:  # a roofline knee somewhere in the plans' range (or before)
            cm.knee = float(rng.integers(0, 2 * batch * width + 2))
            cm.knee_slope = float(rng.uniform(0.001, 0.5))
        survival = np.cumprod(rng.uniform(0.05, 1.0, size=(batch, width)) ** rng.uniform(0.05, 1),
                              axis=1)
        ceilings = rng.integers(0, width + 1, size=batch) if trial % 3 == 0 else np.full(batch, width)
        fixed = int(rng.integers(0, width + 1)) if trial % 5 == 0 else None
        catchup = float(rng.integers(0, 300)) if trial % 4 == 0 else 0.0
        decisions = []
        for use_compiled in (True, False):
            pol = GoodputPolicy(use_compiled=use_compiled)
            decisions.append(pol.decide(survival, ceilings, float(batch + trial % 7), cm,
                                        fixed_k_step=fixed, catchup_tokens=catchup))
            knee_bound += pol._threshold is not None
        fast, reference = decisions
        assert fast.k_step == reference.k_step
        assert fast.k.tolist() == reference.k.tolist()
        assert fast.predicted_seconds == pytest.approx(reference.predicted_seconds, rel=1e-9)
        assert fast.predicted_tokens == pytest.approx(reference.predicted_tokens, rel=1e-9)
        checked += fast.k_step > 0
    assert checked > 50  # most trials speculate, so the slot choice is compared
    assert knee_bound > 20  # and in many of them the knee limited the slots


@pytest.mark.parametrize("roofline", [False, True])
def test_compiled_controller_matches_the_numpy_controller_step_for_step(roofline):
    # The whole controller, compiled loops (policy and probe bookkeeping) vs
    # NumPy paths, on the same traffic: requests whose drafts turn bad and
    # good again (fallback, probes, recoveries), some with a ceiling of 0,
    # requests joining and leaving, and the batch changing size.  With
    # ``roofline`` the step time has a knee at 48 tokens and some steps carry
    # a prefill chunk, so the cost model adopts a knee and the knee-bound
    # plans are compared too.
    from vllm_specplug.controller import compiled

    pytest.importorskip("numba")
    assert compiled.advance_probes is not None
    controllers = [SpecController(ControllerSettings(max_k=6, use_compiled=flag))
                   for flag in (True, False)]
    rng = np.random.default_rng(3)
    live: dict[str, float] = {}
    next_id = 0
    for step in range(600):
        while len(live) < 24 or rng.random() < 0.05:
            live[f"r{next_id}"] = float(rng.uniform(0.0, 0.95))
            ceiling = 0 if next_id % 9 == 0 else None
            for c in controllers:
                c.add_request(f"r{next_id}", ceiling)
            next_id += 1
        if step % 50 == 0:  # the traffic turns: easy requests become hard and back
            live = {r: 0.95 - a for r, a in live.items()}
        batch = [r for r in live if rng.random() < 0.9]
        prefill = int(rng.choice([0, 0, 16, 32, 64, 96])) if roofline else 0
        plans = [c.plan(batch, base_tokens=len(batch) + prefill) for c in controllers]
        assert plans[0].k_step == plans[1].k_step
        assert plans[0].k.tolist() == plans[1].k.tolist()
        accepted = [min(int(rng.geometric(1 - live[r])) - 1, int(k))
                    for r, k in zip(batch, plans[0].k)]
        tokens = len(batch) + prefill + int(plans[0].k.sum())
        past_knee = 0.01 * max(tokens - 48, 0) if roofline else 0.0
        seconds = ((0.05 + 0.004 * tokens + past_knee + 0.01 * plans[0].k_step)
                   * rng.lognormal(0, 0.05))
        for c in controllers:
            c.observe_verifications(batch, plans[0].k.tolist(), accepted)
            c.observe_step(len(batch), tokens, plans[0].k_step, seconds)
        for r in list(live):
            if rng.random() < 0.01:
                del live[r]
                for c in controllers:
                    c.finish_request(r)
    fast, reference = (c.stats for c in controllers)
    assert (fast.probes_sent, fast.probes_succeeded, fast.recoveries) == (
        reference.probes_sent, reference.probes_succeeded, reference.recoveries)
    assert fast.k_histogram == reference.k_histogram
    assert fast.probes_sent > 20 and fast.fallback_request_steps > 0
    print(fast, controllers[0].cost.knee)
    if roofline:
        assert controllers[0].cost.knee is not None
        assert controllers[1].cost.knee == controllers[0].cost.knee
    else:
        assert fast.recoveries > 0


def test_fast_steps_are_kept_when_timed_exactly_and_clipped_under_async():
    # Sync scheduling times each step exactly, and stalls only slow steps
    # down: a fast step is information.  Async scheduling can split one
    # step's time with its neighbour's, so there a fast step is clipped too.
    def after_one_fast_step(keep):
        cm = StepCostModel(CostPrior(intercept=1.0, per_request=0.0, per_token=0.1))
        cm.keep_fast_steps = keep
        rng = np.random.default_rng(0)
        for _ in range(StepCostModel.SKIP_FIRST + 30):
            cm.observe(2, 2, 0, 1.2 * rng.uniform(0.98, 1.02))
        cm.observe(2, 2, 0, 0.3)
        return cm.predict(2, 2, 0)
    assert after_one_fast_step(False) > 1.1
    assert after_one_fast_step(True) < after_one_fast_step(False) - 0.02


def _eagle_c256_seconds(tokens):
    """A step's time in the simulated 8B + EAGLE at c=256: flat up to a ridge at
    480 tokens (memory-bound), then proportional to the tokens (compute-bound)."""
    return 0.001 + max(0.010, 0.010 * tokens / 480)


def _eagle_c256_step(rng, decode_share=1 / 3):
    """(tokens, seconds) of a step like the simulated 8B + EAGLE at c=256.

    A third of the steps decode only: 256 requests, most with a draft
    (416-512 tokens), a few without; the rest carry a 512-token prefill
    chunk or more.  Memory-bound (flat) up to a ridge at 480 tokens,
    compute-bound past it.
    """
    if rng.random() < decode_share:
        drafts = int(rng.integers(0, 40)) if rng.random() < 0.15 else int(rng.integers(160, 257))
        tokens = 256 + drafts
    else:
        tokens = 256 + int(rng.choice([512, 512, 1024, 1536]))
    seconds = _eagle_c256_seconds(tokens) * rng.lognormal(0, 0.02)
    return tokens, seconds


def _eagle_c256_controller(rng):
    """A controller that has learnt the 8B + EAGLE c=256 roofline, with 256 requests added."""
    ctrl = SpecController(ControllerSettings(max_k=4),
                          CostPrior.for_platform("cuda", "model", 0.05, draft_runs_at_k0=True))
    for _ in range(200):
        tokens, seconds = _eagle_c256_step(rng)
        ctrl.observe_step(257, tokens, 1, seconds)
    ids = [f"r{i}" for i in range(256)]
    for r in ids:
        ctrl.add_request(r)
    return ctrl, ids


def test_a_range_of_step_sizes_the_fit_misprices_is_fitted_not_dropped_as_stalls():
    # Slow outliers are dropped (a stall says nothing about the step).  But
    # a linear fit carried by the many steps with a prefill chunk prices
    # every decode-only step too low, and each of those then looked like a
    # stall: in the simulated 8B + EAGLE at c=256, 92 of 107 were dropped,
    # and the fit never learnt what they cost.  A sample is now judged
    # against recent steps of its own size; a lone stall still is dropped.
    rng = np.random.default_rng(3)
    cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.05, draft_runs_at_k0=True))
    stalls = 0
    for i in range(400):
        tokens, seconds = _eagle_c256_step(rng, decode_share=0.25 if i < 100 else 1 / 3)
        if i % 41 == 40:
            seconds *= 8.0  # a stall
            stalls += 1
        cm.observe(257, tokens, 1, seconds)
    assert cm.num_rejected >= stalls
    assert cm.num_rejected < stalls + 20, cm.num_rejected
    for tokens in (420, 512, 768, 1280):
        assert cm.predict(257, tokens, 1) == pytest.approx(_eagle_c256_seconds(tokens),
                                                           rel=0.12), tokens


def test_a_knee_just_above_the_decode_steps_is_found_and_kept():
    # Decode-only steps that all draft sit at 420-512 tokens, steps with a
    # prefill chunk at 768 and more.  The knee at 512 fits best, but it
    # asked for steps at or below 362 (the candidate below it), which only
    # undrafted steps provide; the model flipped between 512, 724 and no
    # knee, and the slope below 724 is twice the one below 512.
    rng = np.random.default_rng(4)
    cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.05, draft_runs_at_k0=True))
    knees = []
    for _ in range(400):
        tokens, seconds = _eagle_c256_step(rng)
        cm.observe(257, tokens, 1, seconds)
        knees.append(cm.knee)
    assert set(knees[-200:]) == {512.0}, sorted(set(map(str, knees[-200:])))
    # The price of a draft in a decode-only step: nearly free below the ridge.
    cheap = cm.predict(257, 512, 1) - cm.predict(257, 420, 1)
    assert cheap < 0.5 * (0.010 * 92 / 480), cheap


def test_probes_wait_for_a_step_below_the_knee():
    # Past the knee a draft costs its compute, below it almost nothing.  In
    # the simulated 8B + EAGLE at c=256 two steps in three carry a prefill
    # chunk that pushes them past the knee, and runs of them sent 29 probes
    # a step into the expensive steps.  A due probe now waits for a step
    # that stays below the knee (up to twice its back-off).
    rng = np.random.default_rng(6)
    ctrl, ids = _eagle_c256_controller(rng)  # the roofline learnt (see the knee test above)
    assert ctrl.cost.knee == 512.0
    previous = np.zeros(256, dtype=int)
    probes = {False: [], True: []}
    for _ in range(300):
        prefill = 512 if rng.random() < 2 / 3 else 0
        sent = ctrl.stats.probes_sent
        d = ctrl.plan(ids, base_tokens=256 + prefill)
        accepted = [simulate_verification(rng, 0.01, k) for k in previous.tolist()]
        ctrl.observe_verifications(ids, previous.tolist(), accepted)
        tokens = 256 + prefill + int(d.k.sum())
        ctrl.observe_step(256 + (prefill > 0), tokens, d.k_step,
                          _eagle_c256_seconds(tokens))
        previous = d.k.copy()
        probes[prefill > 0].append(ctrl.stats.probes_sent - sent)
    # Drafts accepted 1% of the time do not pay even where they are free.
    # (At 0.05 the plan without the chunk drafts for most of the batch: see
    # the next test.)
    assert ctrl.num_in_fallback() > 200
    below, past = np.mean(probes[False]), np.mean(probes[True])
    assert below > 0 and past < 0.25 * below, (below, past)


def test_a_knee_is_kept_when_no_step_is_left_below_it():
    # Once the policy acts on a knee at 512, every decode-only step drafts
    # one token for each of 256 requests and lands on the knee itself: no
    # step is left below it to tell a knee from a linear fit.  The knee
    # stays while so few steps are below it.  It used to fall to none as the
    # steps below it were forgotten (the simulated 8B + EAGLE at c=256 lost
    # it twice a run, and the linear fit then priced drafts in prefill steps
    # like drafts in decode-only ones).
    rng = np.random.default_rng(4)
    cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.05, draft_runs_at_k0=True))
    for _ in range(200):
        tokens, seconds = _eagle_c256_step(rng)
        cm.observe(257, tokens, 1, seconds)
    assert cm.knee == 512.0
    knees = []
    for _ in range(300):
        tokens = 512 if rng.random() < 1 / 3 else 256 + int(rng.choice([512, 512, 1024, 1536]))
        cm.observe(257, tokens, 1, _eagle_c256_seconds(tokens) * rng.lognormal(0, 0.02))
        knees.append(cm.knee)
    assert set(knees) == {512.0}, sorted(set(map(str, knees)))


def test_a_knee_not_seen_from_below_is_read_as_a_roofline():
    # Decode-only steps that all draft sit on the knee (512 tokens) and
    # plain anchors at 256; the true step is flat up to 480 tokens and
    # rises at its compute slope past it.  The fit's slope below the knee
    # only joins 256 and 512 (a fortieth of a decode step per 10 tokens),
    # so every slot up to 512 looked worth a draft accepted 45% of the
    # time.  Read as a roofline (flat, then the slope past the knee) the
    # stretch turns where the truth does, and the plan stops there.
    rng = np.random.default_rng(5)
    cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.05, draft_runs_at_k0=True))
    for i in range(300):
        if rng.random() < 1 / 3:
            tokens = 256 if i % 16 == 0 else 512
        else:
            tokens = 256 + int(rng.choice([512, 512, 1024, 1536]))
        cm.observe(256, tokens, 1, _eagle_c256_seconds(tokens) * rng.lognormal(0, 0.02))
    assert cm.knee == 512.0 and not cm.knee_seen_from_below()
    # (Ties broken as the estimator breaks them.)
    survival = np.full((256, 4), 0.45) ** np.arange(1, 5) - 1e-12 * np.arange(256)[:, None]
    slots = []
    for use_compiled in (True, False):
        d = GoodputPolicy(use_compiled=use_compiled).decide(
            survival, np.full(256, 4), 256.0, cm, explore=False)
        slots.append(int(d.k.sum()))
    assert slots[0] == slots[1]
    assert 480 - 40 <= 256 + slots[0] <= 480 + 10, slots
    # Where steps below the knee place it, the fit is taken as it is.
    for _ in range(200):
        tokens = 256 + int(rng.integers(0, 100)) if rng.random() < 1 / 3 else 768
        cm.observe(256, tokens, 1, _eagle_c256_seconds(tokens) * rng.lognormal(0, 0.02))
    assert cm.knee_seen_from_below()


def test_a_request_left_out_only_by_a_prefill_chunk_is_not_in_fallback():
    # Two steps in three carry a prefill chunk that takes them past the knee,
    # where no draft at 0.3 pays; a step without the chunk drafts for most
    # of the batch (below the knee drafts are almost free).  Counted as
    # fallback, runs of chunked steps made the whole batch due, and late
    # probes went out in those steps at the compute-bound price (the
    # simulated 8B + EAGLE at c=256 sent probes of 240 requests there).
    # Only a request the plan without the chunk leaves out is in fallback.
    rng = np.random.default_rng(6)
    ctrl, ids = _eagle_c256_controller(rng)
    previous = np.zeros(256, dtype=int)
    slots_without, excess = [], []
    for _ in range(300):
        prefill = 512 if rng.random() < 2 / 3 else 0
        d = ctrl.plan(ids, base_tokens=256 + prefill)
        accepted = [simulate_verification(rng, 0.3, k) for k in previous.tolist()]
        ctrl.observe_verifications(ids, previous.tolist(), accepted)
        tokens = 256 + prefill + int(d.k.sum())
        ctrl.observe_step(256 + (prefill > 0), tokens, d.k_step, _eagle_c256_seconds(tokens))
        previous = d.k.copy()
        if prefill:
            assert d.decode_only_k is not None and d.decode_only_k.shape == d.k.shape
            left_out = int(np.count_nonzero(d.decode_only_k == 0))
            excess.append(ctrl.num_in_fallback() - left_out)
        else:
            assert d.decode_only_k is None
            slots_without.append(int(d.k.sum()))
    assert np.mean(slots_without) > 0.6 * 256
    # (The old count held up to the whole batch in fallback: excess 220 on average.)
    assert max(excess) <= 0, max(excess)


def test_a_probe_adds_no_draft_position_to_a_step_that_drafts():
    # 256 requests at acceptance 0.45; the knee has room for one draft for
    # most of them, and the few left out are in fallback and get probed.  A
    # probe that grew to two drafts after an accepted one made the step run
    # a second draft pass over the whole batch for its few tokens (the
    # simulated 8B + EAGLE at c=256: in half the decode-only steps).
    rng = np.random.default_rng(6)
    ctrl, ids = _eagle_c256_controller(rng)
    planned = []
    plan_only = ctrl.goodput.decide

    def recording_decide(*args, **kwargs):
        d = plan_only(*args, **kwargs)
        if "explore" in kwargs:  # the step's plan (the probes' hopeful plan passes none)
            planned.append(d.k_step)
        return d

    ctrl.goodput.decide = recording_decide
    previous = np.zeros(256, dtype=int)
    drafting = deeper = 0
    for _ in range(300):
        planned.clear()
        prefill = 512 if rng.random() < 2 / 3 else 0
        d = ctrl.plan(ids, base_tokens=256 + prefill)
        accepted = [simulate_verification(rng, 0.45, k) for k in previous.tolist()]
        ctrl.observe_verifications(ids, previous.tolist(), accepted)
        tokens = 256 + prefill + int(d.k.sum())
        extra_pass = 0.0005 * max(d.k_step - 1, 0)
        ctrl.observe_step(256 + (prefill > 0), tokens, d.k_step,
                          (_eagle_c256_seconds(tokens) + extra_pass) * rng.lognormal(0, 0.02))
        previous = d.k.copy()
        if planned[-1] > 0:  # (the last: a step with a chunk plans without it first)
            drafting += 1
            deeper += d.k_step > planned[-1]
    assert drafting > 50 and ctrl.stats.probes_sent > 100
    assert deeper == 0  # 14 of 102 before


def test_a_knee_is_found_from_the_few_steps_that_carry_a_prefill_chunk():
    # At c=8 a decode step (8 requests, up to 8 drafts each: 8-72 tokens)
    # stays below a 70B target's ridge (about 180 tokens a pass on H200);
    # only the one step in twenty that carries a 512-token prefill chunk is
    # past it.  Asked for a tenth of the steps past the knee, the model
    # stayed linear, and those few steps priced every verified token at 90
    # us (the simulated 70b-1b, drift, c=8): the cost went to the tokens, a
    # draft pass looked a third of its price, and drafts spread unevenly
    # over the batch (mean K_step 4.8 for a mean k of 3.9).
    rng = np.random.default_rng(8)
    cm = StepCostModel(CostPrior.for_platform("cuda", "model", 0.02, draft_runs_at_k0=True))

    def truth(tokens, k_step):
        return 0.002 + max(0.020, 0.020 * tokens / 180) + 0.0006 * max(k_step - 1, 0)

    for _ in range(300):
        k_step = int(rng.integers(0, 9))
        tokens = 8 + int(rng.integers(0, 8 * k_step + 1))
        if rng.random() < 0.05:
            tokens += 512
        cm.observe(8, tokens, k_step, truth(tokens, k_step) * rng.lognormal(0, 0.02))
    assert cm.knee is not None and cm.knee <= 362
    for tokens, k_step in ((8, 0), (40, 4), (72, 8)):
        assert cm.predict(8, tokens, k_step) == pytest.approx(truth(tokens, k_step), rel=0.05)


def test_plain_anchors_wait_where_speculation_wins_by_far_against_a_measured_plain_step():
    # A plain anchor (two plans at K=0) measures plain decoding, which an
    # all-speculating fit can only extrapolate.  Memory-bound (tokens nearly
    # free), perfect drafts run at about 4x the measured plain step's rate:
    # no plain estimate could turn that into a loss, so once the knee search
    # has twice found no knee, anchors wait, three in a row at most (in the
    # simulator they cost 70B + 1B at one to four requests 2-3% of its rate).
    # Two anchors run: the first (nothing measured yet), then the one after
    # three waits.
    ctrl, k_steps = _anchor_run(per_token=0.0005)
    assert ctrl.stats.plain_anchors_skipped == ctrl.PLAIN_ANCHOR_SKIP_MAX
    assert ctrl.stats.plain_anchors == 2, k_steps
    assert k_steps.count(0) == 2 * ctrl.PLAIN_ANCHOR_STEPS, k_steps
    # Compute-bound (a token costs 16 ms against a 58 ms step): perfect
    # drafts gain 1.55x.  The fit, extrapolating, put plain decoding at 1.9x
    # its true time when the test was against the fit's own plain estimate
    # (and then no anchor corrected it); against the measured step the
    # anchors go on.
    ctrl, k_steps = _anchor_run(per_token=0.0164)
    assert ctrl.stats.plain_anchors_skipped == 0
    assert ctrl.stats.plain_anchors >= 4, k_steps
    plain = true_step_seconds(4, 4, 0, per_token=0.0164, draft=0.002)
    assert abs(ctrl.last_decision.plain_seconds / plain - 1.0) < 0.3


def _anchor_run(per_token: float):
    """Four requests with perfect drafts for 200 steps (``drive``), a draft pass
    costing 2 ms; returns the controller and the K_step of every plan."""
    ctrl = SpecController(ControllerSettings(max_k=4), CostPrior.for_platform("cuda", "model", 0.1))
    _, history = drive(ctrl, [1.0] * 4, 200, np.random.default_rng(0), per_token=per_token,
                       draft=0.002)
    return ctrl, [d.k_step for d in history]
