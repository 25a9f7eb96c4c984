"""The draft-confidence calibration and stop rule (controller/confidence.py): milliseconds, no vLLM."""

import numpy as np
import pytest

from vllm_specplug.controller import ControllerSettings, SpecController, StepProfile
from vllm_specplug.controller.confidence import (PRIOR_WEIGHT, ConfidenceCalibration,
                                                 DraftStopper, StopRule)


def rule(cond, caps, slot_cuts=(0.0,), pass_cut=0.0, cal=None, ids=None):
    """A rule whose every further pass is priced ``pass_cut`` (a number, or one per pass)."""
    cond = np.asarray(cond, dtype=np.float64)
    cal = cal or ConfidenceCalibration(cond.shape[1])
    cuts = np.broadcast_to(np.asarray(pass_cut, dtype=np.float64), (cond.shape[1],)).copy()
    return StopRule(ids or [f"r{i}" for i in range(cond.shape[0])], cond,
                    np.asarray(caps, dtype=np.int64), *cal.observed(), cal.edges,
                    np.asarray(slot_cuts, dtype=np.float64), cuts)


def test_a_cold_calibration_leaves_the_history_estimate_as_it_is():
    cal = ConfidenceCalibration(4)
    assert not cal.observed()[1].any()
    st = DraftStopper(rule([[0.8, 0.8, 0.8, 0.8]], [4]), np.array([0]))
    st.after_position(np.array([0.1]))
    assert st.survival[0] == pytest.approx(0.8)


def test_a_bin_with_outcomes_outweighs_the_history_estimate():
    cal = ConfidenceCalibration(4)
    # 36 drafts under 0.3 confidence, 9 accepted (each its request's first draft).
    cal.observe([[0.1]] * 36, [1] * 9 + [0] * 27)
    st = DraftStopper(rule([[0.9] * 4], [4], cal=cal), np.array([0]))
    st.after_position(np.array([0.1]))
    # The bin's 0.25, with the history's 0.9 worth PRIOR_WEIGHT outcomes.
    assert st.survival[0] == pytest.approx((9 + PRIOR_WEIGHT * 0.9) / (36 + PRIOR_WEIGHT))
    assert st.survival[0] < 0.35


def test_the_calibration_learns_that_confident_drafts_are_accepted():
    rng = np.random.default_rng(0)
    cal = ConfidenceCalibration(4)
    for _ in range(2000):
        conf = rng.beta(2.0, 1.0, size=4)  # drafts are mostly sure
        # The target accepts a draft with its confidence as the chance.
        ok = rng.uniform(size=4) < conf
        a = int(np.argmin(ok)) if not ok.all() else 4
        cal.observe([conf.tolist()], [a])
    low, mid, high = cal.predict(np.zeros(3, dtype=np.int64), np.array([0.1, 0.6, 0.99]))
    # The chance follows the confidence (the target accepts with it as the chance).
    assert low < 0.25 and 0.5 < mid < 0.7 and high > 0.95
    # One count per bin for every position: each bin learns from all of them.
    acc, n = cal.observed()
    assert n.shape == (cal.edges.size + 1,)
    assert n.sum() > 0 and (acc <= n + 1e-9).all()


def test_only_the_accepted_drafts_and_the_first_rejection_are_outcomes():
    cal = ConfidenceCalibration(4)
    cal.observe([[0.99, 0.99, 0.1, 0.99]], [2])  # 2 accepted, the third rejected
    acc, n = cal.observed()
    assert n.sum() == pytest.approx(3.0)
    assert acc.sum() == pytest.approx(2.0)
    assert cal.by_position[1, 3] == 0  # never tested


def test_a_request_stops_at_its_first_slot_that_does_not_pay():
    cal = ConfidenceCalibration(4)
    cal.observe([[0.05]] * 100, [0] * 100)  # a draft under 0.3 confidence is never accepted
    r = rule([[0.9] * 4, [0.9] * 4], [4, 4], slot_cuts=[0.2], pass_cut=0.0, cal=cal)
    st = DraftStopper(r, np.array([0, 1]))
    assert st.after_position(np.array([0.99, 0.99]))
    assert st.after_position(np.array([0.99, 0.05]))  # row 1's second draft is hopeless
    assert list(st.limits()) == [2, 1]
    assert not st.active[1]


def test_a_slot_is_priced_at_the_place_it_takes_in_the_step():
    """The step's first verified drafts can cost nothing and the later ones much (a batch whose
    verification is free up to some tokens): the surest slots take the cheap places, and a
    doubtful one is kept only while a cheap place is left for it."""
    cuts = [0.0, 0.0, 0.0, 0.7]
    st = DraftStopper(rule([[0.6] * 4] * 3, [4, 4, 4], slot_cuts=cuts), np.array([0, 1, 2]))
    # Three slots at 0.6 each take the three free places.
    assert st.after_position(np.array([0.1, 0.1, 0.1]))
    assert list(st.limits()) == [1, 1, 1]
    # Their next slots (survival 0.36) would take places priced 0.7: none pays, none runs.
    assert not st.after_position(np.array([0.1, 0.1, 0.1]))
    assert list(st.limits()) == [1, 1, 1]
    # With one place left free, the surest of two new slots takes it.
    st = DraftStopper(rule([[0.6] * 4, [0.9] * 4], [4, 4], slot_cuts=[0.0, 0.0, 0.0, 0.7]),
                      np.array([0, 1]))
    st.after_position(np.array([0.1, 0.1]))
    st.after_position(np.array([0.1, 0.1]))
    # Places 1-2: 0.6 and 0.9; then 0.81 takes the free place 3 and 0.36 misses place 4's 0.7.
    assert list(st.limits()) == [1, 2]
    st = DraftStopper(rule([[0.6] * 4] * 2, [4, 4], slot_cuts=[0.0, 0.0, 0.0, 0.7]),
                      np.array([0, 1]))
    st.after_position(np.array([0.1, 0.1]))
    st.after_position(np.array([0.1, 0.1]))
    assert sorted(st.limits()) == [1, 2]  # 0.36 and 0.36: one free place, one at 0.7


def test_the_loop_ends_when_no_next_position_pays_its_pass():
    r = rule([[0.5] * 6], [6], pass_cut=0.3)
    st = DraftStopper(r, np.array([0]))
    # Survival 0.5; the next position adds 0.25 expected tokens < 0.3.
    assert not st.after_position(np.array([0.5]))
    assert list(st.limits()) == [1]
    # Two requests share the pass: 0.25 + 0.25 pays for it.
    st = DraftStopper(rule([[0.5] * 6] * 2, [6, 6], pass_cut=0.3), np.array([0, 1]))
    assert st.after_position(np.array([0.5, 0.5]))


def test_each_further_pass_is_priced_at_its_own_place():
    # The second pass is free, the third dear: the loop runs the second, stops before the third.
    st = DraftStopper(rule([[0.9] * 6], [6], pass_cut=[0.0, 0.85, 0.0, 0.0, 0.0, 0.0]),
                      np.array([0]))
    assert st.after_position(np.array([0.9]))      # 0.81 expected from the second pass >= 0
    assert not st.after_position(np.array([0.9]))  # 0.73 from the third < 0.85
    assert list(st.limits()) == [2]


def test_a_pass_past_the_plans_row_is_priced_at_the_correction_of_its_own_count():
    """Steps of eight passes measured dearer than the profile (the correction's 8+ row)
    while four-pass steps ran at it: a four-pass plan's stop prices passes five to seven
    at the profile's pass, the eighth at what an eight-pass plan costs over a seven-pass
    one, as the argmax prices them."""
    profile = StepProfile([1, 16, 128], [1.0, 1.0, 1.2], [0.15] * 3, [1, 64], [0.05, 0.06])
    ctrl = SpecController(ControllerSettings(max_k=8), profile)
    pricer = ctrl.pricer
    for _ in range(200):
        for k_step, scale in ((4, 1.0), (8, 1.5)):
            tokens = 1 + k_step
            pricer.observe(tokens, 1, k_step, scale * pricer.profiled(tokens, 1, k_step))
    ctrl.add_request("a")
    for _ in range(8):  # good drafts
        d = ctrl.plan(["a"])
        ctrl.observe_verifications(["a"], d.k, d.k)
    d = ctrl.plan(["a"])
    r = ctrl.stop_rule(d)
    assert r is not None and d.k_step >= 1
    cuts = r.pass_cuts  # cuts[j]: the pass after j + 1
    rate = d.predicted_tokens / d.predicted_seconds
    assert cuts[3:6] == pytest.approx(np.full(3, rate * 0.05), rel=0.1)  # passes 5-7
    # The eighth: the whole seven-pass step's cost rises by half, more than ten passes.
    assert cuts[6] > 10 * cuts[5]


def test_caps_fallback_rows_and_rows_the_plan_did_not_cover():
    r = rule([[0.99] * 4, [0.99] * 4], [2, 0])
    st = DraftStopper(r, np.array([0, 1, -1]))
    assert st.after_position(np.ones(3) * 0.99)
    assert not st.after_position(np.ones(3) * 0.99)  # the only active row reached its cap
    assert list(st.limits()) == [2, 0, -1]


def test_the_controller_sends_a_rule_only_for_an_unpinned_drafting_plan():
    profile = StepProfile([1, 16, 128], [1.0, 1.0, 1.2], [0.15] * 3, [1, 64], [0.05, 0.06])
    ctrl = SpecController(ControllerSettings(max_k=4), profile)
    ids = ["a", "b"]
    for rid in ids:
        ctrl.add_request(rid)
    for _ in range(6):  # perfect drafts
        d = ctrl.plan(ids)
        ctrl.observe_verifications(ids, d.k, d.k)
    d = ctrl.plan(ids)
    assert d.k_step > 0
    r = ctrl.stop_rule(d)
    assert r is not None and r.req_ids == ids and list(r.caps) == [4, 4]
    rate = d.predicted_tokens / d.predicted_seconds
    # Every further pass at the profile's 0.05 s (no correction learnt yet).
    assert r.pass_cuts == pytest.approx(np.full(3, rate * 0.05), rel=0.05)
    assert ctrl.stop_rule(ctrl.plan(ids, fixed_k_step=4)) is None
    for rid in ids:
        ctrl.set_ceiling(rid, 0)
    assert ctrl.stop_rule(ctrl.plan(ids)) is None


def learnt(profile, acc):
    """A controller whose one request ("a") has had 200 steps of drafts each
    accepted with chance ``acc`` (cold calibration, no profile correction)."""
    ctrl = SpecController(ControllerSettings(max_k=8, profile_correction=False), profile)
    ctrl.add_request("a")
    rng = np.random.default_rng(1)
    for _ in range(200):
        d = ctrl.plan(["a"])
        k = int(d.k[0]) or 1
        ok = rng.uniform(size=k) < acc
        ctrl.observe_verifications(["a"], [k], [int(np.argmin(ok)) if not ok.all() else k])
    return ctrl


def stop_position(r):
    """Where the loop ends under rule ``r``, every draft at confidence 0.5."""
    st = DraftStopper(r, np.array([0]))
    while st.after_position(np.array([0.5])):
        pass
    return st.position


def test_the_stop_agrees_with_the_argmax_on_history_alone():
    """With a cold calibration, the loop stops where the plan's own K_step does
    (the plan's argmax, one position at a time) for a single request."""
    profile = StepProfile([1, 16, 128], [1.0, 1.0, 1.2], [0.15] * 3, [1, 64], [0.2, 0.2])
    for acc in (0.5, 0.7, 0.8, 0.9, 0.97):
        ctrl = learnt(profile, acc)
        d = ctrl.plan(["a"])
        r = ctrl.stop_rule(d)
        if d.k_step == 0:
            continue
        pos = stop_position(r)
        assert abs(pos - d.k_step) <= 1, (acc, pos, d.k_step)


def test_a_prefill_chunk_in_the_step_does_not_make_every_pass_pay():
    """A prompt's step is long whatever is drafted: the stop prices a pass at the
    rate the plan's argmax maximised (its decoding), as in a step without the
    chunk, and stops where that step's plan would."""
    profile = StepProfile([1, 16, 128, 1024], [1.0, 1.0, 1.2, 6.0], [0.15, 0.15, 0.2, 1.0],
                          [1, 64], [0.2, 0.2])
    cuts = {}
    for chunk in (0, 600):
        ctrl = learnt(profile, 0.8)
        d = ctrl.plan(["a"], base_tokens=1 + chunk)
        assert d.k_step > 0
        r = ctrl.stop_rule(d)
        pos = stop_position(r)
        assert abs(pos - d.k_step) <= 1, (chunk, pos, d.k_step)
        cuts[chunk] = r.pass_cuts[0]
    # The step with the chunk takes several times as long; its slots cost more
    # (600 tokens on), its pass is worth about as much.
    assert cuts[600] > 0.7 * cuts[0]
