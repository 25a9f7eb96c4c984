"""The controller in closed loops: fallback, probes, plain probes, ceilings, policies, freed state
(milliseconds, no vLLM; ``controller_cases`` for the profiles and drivers)."""

import math

import numpy as np
import pytest

from vllm_specplug.controller import (
    ControllerSettings,
    GoodputPolicy,
    ProfileCorrection,
    SpecController,
    StepPricer,
    StepProfile,
    prior_profile,
)

from controller_cases import (
    GPU_LIKE,
    MODERATE,
    CPU_BOUND,
    QWEN_CPU,
    tiny_serve_profile,
    simulate_verification,
    drive,
    drive_perfect_drafts,
    drive_true_prices,
)


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
    # Steps run at their profile price exactly: what is compared is the
    # acceptance the probes win back, not a price's wander under step noise
    # (at 10% noise the plain price's running median alone moves the
    # predicted speedup by 5-10% from seed to seed, either way).
    settings = ControllerSettings(max_k=8)
    rng = np.random.default_rng(5)
    _, fresh = drive(SpecController(settings, MODERATE), [0.97] * 4, 150, rng, noise=0.0)
    steady = np.mean([d.k.mean() for d in fresh[-30:]])
    steady_speedup = np.mean([d.predicted_speedup for d in fresh[-30:]])
    assert steady >= 5
    ctrl = SpecController(settings, MODERATE)
    _, bad = drive(ctrl, [0.02] * 4, 150, rng, noise=0.0)
    assert all(d.k_step == 0 or d.k.max() <= 2 for d in bad[-50:])
    assert ctrl.num_in_fallback() == 4
    sent, succeeded = ctrl.stats.probes_sent, ctrl.stats.probes_succeeded
    assert sent > 0
    _, good = drive(ctrl, [0.97] * 4, 150, rng, noise=0.0)
    recovered_at = next(i for i, d in enumerate(good) if d.k.min() >= 4)
    assert recovered_at <= settings.probe_max_interval + 16, [d.k.tolist() for d in good]
    # Back to where the fresh controller is: its predicted goodput (K=6 and
    # K=8 are within a percent of each other here, so the K itself is a tie).
    assert np.mean([d.k.mean() for d in good[-30:]]) >= 5
    # (The pooled acceptance still remembers the bad phase a little: 0.97 here.)
    assert np.mean([d.predicted_speedup for d in good[-30:]]) >= 0.95 * steady_speedup
    assert ctrl.stats.probes_succeeded > succeeded and ctrl.stats.recoveries >= 1
    assert ctrl.num_in_fallback() == 0





def test_a_plain_step_the_plan_never_runs_is_measured_by_a_plain_probe(monkeypatch):
    # Served at four requests on this CPU, the plain step ran 0.8x its
    # start-up price while drafting steps ran at theirs; the plan drafted
    # every step, a plain step of four requests never ran, so its price
    # never moved, and vLLM's plain decoding beat every drafting arm.  A
    # plain probe measures it, and the plan decodes plainly from then on.
    # (Drafts accepted 85% of the time: at 80% the plan is near break-even
    # and falls back by itself in its first steps, which measures the price.)
    ctrl = SpecController(ControllerSettings(max_k=4), QWEN_CPU)
    k_steps = drive_true_prices(ctrl, 0.85, 4, 300, 0.8, np.random.default_rng(0))
    assert ctrl.stats.plain_probes == 1
    assert (k_steps[-150:] == 0).mean() >= 0.9
    assert ctrl.pricer.seconds(4, 4, 0) == pytest.approx(0.8 * QWEN_CPU.step(4, 4, 0), rel=0.05)
    # Without the probe the plan drafts on.
    monkeypatch.setattr(SpecController, "_plain_probe", lambda self, *a: None)
    ctrl = SpecController(ControllerSettings(max_k=4), QWEN_CPU)
    k_steps = drive_true_prices(ctrl, 0.85, 4, 300, 0.8, np.random.default_rng(0))
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
    assert corr.ratio(1, 1, 0) == pytest.approx(1.23)
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
    # Drafts for the good requests every step, as deep as drafts this good pay
    # (K = 4-8 price within a few percent of each other here; each pass
    # count's price wanders with the 10% step noise on its own).
    assert late[:, 0::2].min() >= 3 and np.median(late[:, 0::2]) >= 5
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
    # A few correction steps, not the slowdown: every ratio it learnt.
    assert max(math.log(r) for r in corr.learnt().values()) <= corr.step * 4


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
