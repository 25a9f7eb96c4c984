"""The step-cost profile and its live correction (milliseconds, no vLLM)."""

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

from controller_cases import MODERATE, QWEN_CPU, tiny_serve_profile, random_profile
from vllm_specplug.controller.pricing import decode_curve


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


def test_first_pass_past_its_sizes_grows_as_the_catch_up():
    """Past its largest size the first pass (the draft's forward over a step's
    tokens, a prompt chunk's included) grows at least at the catch-up's
    per-token slope: the first pass is timed at decoding sizes, where a
    pass's fixed cost hides its slope, the catch-up over hundreds of tokens.
    The Qwen pair's numbers: extended with its own slope a 480-token prompt
    chunk's draft work read 0.27 s; served it cost 1.1 s."""
    sizes, target, first = [1, 18, 36], [0.15, 0.24, 0.40], [0.05, 0.107, 0.115]
    own = StepProfile(sizes, target, first, [1, 4], [0.05, 0.05])
    zero_cost = StepProfile(sizes, target, first, [1, 4], [0.05, 0.05],
                            catchup_tokens=[62, 144, 296], catchup_s=[0.159, 0.318, 0.647],
                            meta={"zero_cost_fallback": True})
    slope = (0.647 - 0.318) / (296 - 144)
    assert own.first(480) - own.first(36) == pytest.approx(444 * 0.008 / 18)
    assert zero_cost.first(480) - zero_cost.first(36) == pytest.approx(444 * slope)
    assert zero_cost.first(20) == own.first(20)  # within its sizes: as measured
    t = np.array([20.0, 480.0])
    assert zero_cost.verify_and_first(t) == pytest.approx(
        [zero_cost.target(x) + zero_cost.first(x) for x in t])
    # What a drafting plan pays for a new prompt's pass over it (GoodputPolicy.prices).
    pr = GoodputPolicy().prices(8, 1, 8 + 472, StepPricer(zero_cost))
    assert pr.unseen_s == pytest.approx(zero_cost.first(480) - zero_cost.first(8))
    assert pr.unseen_s > 0.9





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
    assert not corr._chunk.any() and not corr._offset.any() and corr._level == 0.0


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
    # of each count's own band, row j at K_step j.
    corr = ProfileCorrection(step=0.3)
    rng = np.random.default_rng(1)
    for _ in range(600):
        corr.observe(float(rng.integers(1, 1 << 14)), int(rng.integers(1, 9)), 1.0,
                     float(rng.lognormal(0.0, 0.6)), int(rng.integers(1, 12)))
    for _ in range(100):
        start, count = int(rng.integers(1, 9000)), int(rng.integers(1, 700))
        batch, width = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        got = corr.ratios_from(start, count, batch, width)
        want = [[corr.ratio(t, batch, max(j, 1)) for t in range(start, start + count)]
                for j in range(width + 1)]
        assert got.shape == (width + 1, count) and np.allclose(got, want, rtol=1e-12)


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


def test_a_request_bands_drafting_price_stays_while_other_bands_draft():
    # Served Qwen pair on a CPU, the A/B at f8c9bab (one server for every
    # arm): with one price per pass count shared by every batch size, the
    # steps of other sizes and pass counts run between two eight-request
    # drafting waves carried it back to their level, and each wave's first
    # ten steps ran 13% over their price (drafting where plain was faster).
    # Here one request's steps run at 0.75x their profile price, eight
    # requests' at 1.0x.  Each request band keeps the offset its drafting steps
    # learnt over the pass counts' levels, learnt while one request's
    # drafting steps (the band without one) run too: one band's steps alone
    # cannot tell the host's error from the band's, and go to the level
    # (test_a_mismatch_learnt_on_drafting_steps_prices_plain_steps_too).
    profile = served_qwen_profile()
    pricer = StepPricer(profile, width=8)

    def run(batch, k, ratio, steps):
        tokens = batch * (1 + k)
        for _ in range(steps):
            assert pricer.observe(tokens, batch, k, ratio * pricer.profiled(tokens, batch, k))

    def priced(batch, k):
        tokens = batch * (1 + k)
        return pricer.seconds(tokens, batch, k) / pricer.profiled(tokens, batch, k)

    for _ in range(4):  # waves of one request and of eight, one after the other
        run(1, 1, 0.75, 60)
        run(8, 1, 1.0, 40)
        assert priced(8, 1) == pytest.approx(1.0, rel=0.03)
    run(1, 1, 0.75, 300)  # then a long run of one request's steps
    assert priced(1, 1) == pytest.approx(0.75, rel=0.03)
    assert priced(8, 1) == pytest.approx(1.0, rel=0.05)  # kept (one shared price: 0.75)
    # A host that slows down moves every band with it.
    run(1, 1, 0.9, 60)
    assert priced(8, 1) == pytest.approx(1.2, rel=0.05)
    # Four requests never drafted: priced at the pass counts' level alone.
    assert priced(4, 1) == pytest.approx(0.9, rel=0.03)
    # Four requests alone for long, 1.2x: once one request's steps are
    # forgotten, the rest of the error goes to the level, one request's too.
    run(4, 1, 1.2, 2000)
    assert priced(4, 1) == pytest.approx(1.2, rel=0.03)
    assert priced(1, 1) > 1.0


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


def served_qwen_profile() -> StepProfile:
    """The Qwen pair's start-up profile of the A/B grid at ad3b4f0 (this CPU,
    bfloat16, zero-cost fallback): its 4-token target point measured low, so
    the verify curve is not convex from four requests up."""
    return StepProfile([1, 2, 4, 9, 18, 36], [0.1817, 0.1678, 0.1283, 0.1680, 0.2392, 0.3876],
                       [0.0550, 0.0526, 0.0450, 0.0851, 0.0607, 0.1527], [1, 2, 4],
                       [0.0570] * 3, catchup_tokens=[62, 144, 296],
                       catchup_s=[0.166, 0.337, 0.648], meta={"zero_cost_fallback": True})


def test_a_plain_price_measured_stays_its_own_while_drafting_steps_move_the_level():
    # Served ShareGPT at eight requests (A/B grid at ad3b4f0): plain steps of
    # eight ran 0.96x their profile price; then drafting steps ran 1.1-1.3x
    # theirs.  With plain priced at the level times its residual, each
    # drafting step raised the plain price too (0.147 -> 0.21 s in one
    # wave, no plain step run), the K=1 step stayed at 1.4x plain where it
    # ran at 1.8x, and the plan drafted a wave that plain decoding would have
    # run 10-25% faster.  A plain shape measured lately keeps its own price.
    profile = served_qwen_profile()
    pricer = StepPricer(profile, width=8)
    for _ in range(63):
        assert pricer.observe(8, 8, 0, 0.96 * profile.step(8, 8, 0))
    plain = pricer.seconds(8, 8, 0)
    assert plain == pytest.approx(0.96 * profile.step(8, 8, 0), rel=0.01)
    for i in range(60):
        k = (2, 4, 8)[i // 20]
        tokens = 8 + 8 * k
        assert pricer.observe(tokens, 8, k, 1.25 * pricer.profiled(tokens, 8, k))
    corr = pricer.correction
    assert corr.learnt()["common"] > 1.2  # the level: the drafting steps' error
    # The plain step's own measurement, forgotten a little toward the prior
    # in 60 steps (weight 0.998^60), not moved 1.25x with the level.
    assert plain <= pricer.seconds(8, 8, 0) < 1.03 * plain
    # A plain shape never measured is priced at the prior, which moved.
    assert pricer.seconds(32, 32, 0) > 1.15 * profile.step(32, 32, 0)
    # Plain steps measured again: the price is theirs alone.
    for _ in range(10):
        assert pricer.observe(8, 8, 0, 0.96 * profile.step(8, 8, 0))
    assert pricer.seconds(8, 8, 0) == pytest.approx(0.96 * profile.step(8, 8, 0), rel=0.01)


def test_a_drafting_step_is_corrected_against_the_price_its_plan_read():
    # The same profile at four requests: the plans price a K=1 step (8
    # tokens) on the verify curve made convex from 4 to 36 tokens, 0.209 s,
    # where the profile's own point is 0.237 s; served the step ran 0.23 s.
    # Corrected against the point, the correction learnt about 1 and the
    # plans kept the convex curve's 12% discount: K=1 priced 1.5x a plain step
    # where it ran 1.95x.  Corrected against the curve, the plans pay what the
    # steps measured.
    profile = served_qwen_profile()
    curve = decode_curve(profile, 4, 4, 8)
    assert curve[4] < 0.9 * profile.step(8, 4, 1)  # the curve's discount at K=1
    pricer = StepPricer(profile, width=8)
    for _ in range(60):
        assert pricer.observe(8, 4, 1, 0.23)
    pr = GoodputPolicy().prices(4, 8, 4.0, pricer)
    assert pr.by_n[4] * pr.ratios(5)[1, 4] == pytest.approx(0.23, rel=0.01)
    assert pricer.profiled(8, 4, 1) == pytest.approx(curve[4])
    # Without the plans' width (or past their slots) the profile's point is the price.
    assert StepPricer(profile).profiled(8, 4, 1) == profile.step(8, 4, 1)
    assert pricer.profiled(40, 4, 1) == profile.step(40, 4, 1)


def test_a_k1_plan_reads_its_own_steps_not_the_k2_steps_in_its_token_band():
    # Served at eight requests (A/B grid at e20e290, the fixed-k arms on the
    # same server): K = 2 steps (24 tokens) ran 1.02x the profile, K = 1
    # steps (16 tokens, the same token band) 1.15x.  Keyed by tokens alone,
    # the first K = 1 plans after a K = 2 wave read 1.02x and priced the step
    # 0.265 s where it ran 0.33 s; the plan entered drafting at a loss.  Keyed
    # by draft passes as well, each plan reads the steps with its passes.
    profile = served_qwen_profile()
    pricer = StepPricer(profile, width=8)
    for _ in range(60):
        assert pricer.observe(16, 8, 1, 1.15 * pricer.profiled(16, 8, 1))
    for _ in range(60):
        assert pricer.observe(24, 8, 2, 1.02 * pricer.profiled(24, 8, 2))
    assert pricer.seconds(16, 8, 1) == pytest.approx(1.15 * pricer.profiled(16, 8, 1), rel=0.03)
    assert pricer.seconds(24, 8, 2) == pytest.approx(1.02 * pricer.profiled(24, 8, 2), rel=0.01)
    pr = GoodputPolicy().prices(8, 8, 8.0, pricer)
    ratios = pr.ratios(17)
    assert ratios[1, 8] == pytest.approx(pricer.correction.ratio(16, 8, 1))
    assert ratios[2, 16] == pytest.approx(pricer.correction.ratio(24, 8, 2))
    assert ratios[1, 8] > 1.1 * ratios[2, 8]  # one token band, two prices
    # A pass count no step has run is priced at the level.
    assert ratios[4, 8] == pytest.approx(pricer.correction.ratio(16, 8, 4))


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
