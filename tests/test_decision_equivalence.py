"""The controller's decisions are those of its pre-optimisation implementation.

The reference was a verbatim copy of ``vllm_specplug.controller`` as it was
before the decision-cost work (issue 49): plain NumPy, a full sort and a
K_step x slots matrix per decision, kept in ``tests/reference_controller``
until its decisions on these tests' inputs were recorded in
``tests/data/reference_decisions.npz`` (``tests/data/record_reference.py``
made it, and says how to make it again).  Every optimisation must leave every
decision as it was: the same K_step and per-request k (on an exact tie of two
plans' rates, either), the same predictions (to 1e-9 relative), the same
controller counters, and the estimator's tables bit for bit (recorded as
digests).  Random inputs, seeded; no vLLM, a few seconds.
"""

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import vllm_specplug.controller as new

RTOL = 1e-9
RECORDED = Path(__file__).resolve().parent / "data" / "reference_decisions.npz"
PREDICTIONS = ("predicted_seconds", "predicted_tokens", "plain_seconds", "plain_tokens")
STATS = ("steps", "sum_k_step", "granted_slots", "fallback_request_steps",
         "probes_sent", "probes_succeeded", "recoveries", "drafted", "accepted")
GOODPUT_SEEDS, GOODPUT_CASES = range(20), 150
TRAFFIC_SEEDS, TRAFFIC_STEPS = range(12), 300
BENCHMARK_BATCHES, BENCHMARK_STEPS = (1, 64, 512), 150
ESTIMATOR_SEEDS, ESTIMATOR_STEPS = range(6), 300


@pytest.fixture(autouse=True)
def _no_plain_probes(monkeypatch):
    """The reference predates plain probes (a run of plain steps the plan did
    not choose, ``SpecController._plain_probe``; tested in test_controller.py):
    compared with them off."""
    monkeypatch.setattr(new.SpecController, "_plain_probe", lambda self, *a: None)


@pytest.fixture(scope="module")
def recorded():
    with np.load(RECORDED) as z:
        return {name: z[name] for name in z.files}


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b))


def assert_same(got, want, where="", priced=True):
    """The same plan; with ``priced``, the same predictions too."""
    assert got.k_step == want.k_step, where
    np.testing.assert_array_equal(got.k, want.k, err_msg=where)
    for name in PREDICTIONS if priced else PREDICTIONS[2:]:
        assert _close(getattr(got, name), getattr(want, name)), (where, name)


# -- recorded decisions ---------------------------------------------------------------
def pack(name: str, decisions) -> dict[str, np.ndarray]:
    """Decisions as arrays (``name.k_step``, ``name.k`` end to end with
    ``name.lengths``, ``name.predictions``), for the recorded file."""
    ks = [np.asarray(d.k, dtype=np.int64) for d in decisions]
    return {f"{name}.k_step": np.array([int(d.k_step) for d in decisions], dtype=np.int16),
            f"{name}.k": np.concatenate(ks + [np.zeros(0, np.int64)]).astype(np.int8),
            f"{name}.lengths": np.array([k.size for k in ks], dtype=np.int16),
            f"{name}.predictions": np.array(
                [[float(getattr(d, p)) for p in PREDICTIONS] for d in decisions],
                dtype=np.float64).reshape(-1, len(PREDICTIONS))}


def unpack(recorded: dict, name: str) -> list:
    """The recorded decisions ``pack`` wrote under ``name``."""
    k, at = recorded[f"{name}.k"], np.cumsum(np.r_[0, recorded[f"{name}.lengths"]])
    return [SimpleNamespace(k_step=int(k_step), k=k[at[i]:at[i + 1]].astype(np.int64),
                            **dict(zip(PREDICTIONS, map(float, predictions))))
            for i, (k_step, predictions) in enumerate(zip(recorded[f"{name}.k_step"],
                                                          recorded[f"{name}.predictions"]))]


def digest(a: np.ndarray) -> str:
    """An array's shape, type and bytes (the estimator's tables, bit for bit)."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.shape} {a.dtype}".encode() + a.tobytes()).hexdigest()[:16]


# -- random inputs --------------------------------------------------------------------
def random_profile_dict(rng) -> dict:
    def sizes(n, top):
        return np.unique(np.round(np.geomspace(1, top, n)) + rng.integers(0, 3, n)).tolist()

    tokens = sizes(int(rng.integers(1, 9)), float(rng.choice([8, 512, 8192])))
    batch = sizes(int(rng.integers(1, 7)), float(rng.choice([4, 64, 1024])))
    t = np.asarray(tokens)
    target = rng.uniform(1e-3, 20e-3) + rng.uniform(0, 1e-3) * t * rng.choice([0.01, 1.0])
    target = target * rng.uniform(0.9, 1.1, t.size)  # not always monotone
    first = (rng.uniform(0, 0.5) * target * rng.uniform(0.8, 1.2, t.size)
             if rng.random() < 0.8 else np.zeros(t.size))
    passes = rng.uniform(0, 3e-3) * (1.0 + rng.uniform(0, 0.05) * np.asarray(batch))
    d = {"tokens": tokens, "target_s": target.tolist(), "first_s": first.tolist(),
         "batch": batch, "pass_s": passes.tolist(),
         "meta": {"zero_cost_fallback": bool(rng.random() < 0.5)}}
    if rng.random() < 0.4:
        c = sizes(int(rng.integers(1, 5)), 2048.0)
        d["catchup_tokens"] = c
        d["catchup_s"] = (rng.uniform(0, 2e-3) + rng.uniform(0, 1e-5) * np.asarray(c)).tolist()
    if rng.random() < 0.4:
        d["pad_sizes"] = sorted(set(rng.integers(1, 2048, int(rng.integers(1, 12))).tolist()))
    return d


def random_pricer(rng, module=new):
    """A pricer of ``module`` (this package or the reference) on a random profile."""
    pricer = module.StepPricer(module.StepProfile.from_dict(random_profile_dict(rng)))
    for _ in range(int(rng.choice([0, 3, 40]))):  # a correction with a few shapes moved
        pricer.observe(float(rng.integers(1, 5000)), int(rng.integers(1, 600)),
                       int(rng.integers(0, 9)), float(rng.uniform(1e-4, 0.2)))
    return pricer


def random_survival(rng, batch: int, width: int) -> np.ndarray:
    """Rows non-increasing along positions; some below MIN_SURVIVAL, some tied;
    a few unsorted."""
    kind = rng.integers(0, 6)
    if kind == 5:  # survivals within a hair of each other (the sort's slow path)
        return np.sort(0.5 + 1e-9 * rng.random((batch, width)), axis=1)[:, ::-1].copy()
    if kind == 4:  # not what the estimator gives, but the rule is defined for it
        return rng.choice([rng.uniform(0, 1, (batch, width)),
                           rng.choice([0.0005, 0.3, 0.6], (batch, width))])
    if kind == 0:
        alpha = rng.uniform(0.0, 1.0, (batch, width))
    elif kind == 1:
        alpha = rng.uniform(0.5, 1.0, (batch, width)) ** rng.uniform(0.1, 3.0, (batch, 1))
    elif kind == 2:  # coarse values: ties within and across rows
        alpha = rng.choice([0.25, 0.5, 0.75, 1.0], (batch, width))
    else:
        alpha = np.broadcast_to(rng.uniform(0.3, 1.0, (1, width)), (batch, width))
    surv = np.cumprod(alpha, axis=1)
    if rng.random() < 0.5:  # the estimator's tie-break
        surv = surv - (rng.permutation(batch) * 1e-12)[:, None]
    return np.ascontiguousarray(surv)


def random_decide_args(rng):
    batch = int(rng.choice([1, 2, 3, 8, 64, 600]) if rng.random() < 0.5
                else rng.integers(1, 601))
    width = int(rng.integers(1, 11))
    survival = random_survival(rng, batch, width)
    ceilings = rng.integers(0, width + 2, batch) if rng.random() < 0.7 else np.full(batch, width)
    base = float(batch + (rng.integers(0, 2048) if rng.random() < 0.4 else 0))
    fixed = None if rng.random() < 0.7 else int(rng.integers(0, width + 3))
    kw = {"fixed_k_step": fixed}
    if rng.random() < 0.5:
        kw.update(catch_up_s=float(rng.uniform(0, 0.05)), skip_s=float(rng.uniform(0, 0.01)),
                  horizon=float(rng.uniform(1, 5000)) if rng.random() < 0.7 else None)
    return survival, ceilings.astype(np.int64), base, kw



def goodput_cases(seed: int, module=new):
    """One seed's random cases for ``module``'s ``GoodputPolicy``: (policy, decide's arguments)."""
    rng = np.random.default_rng(seed)
    for _ in range(GOODPUT_CASES):
        survival, ceilings, base, kw = random_decide_args(rng)
        pricer = random_pricer(rng, module)
        min_gain = float(rng.choice([0.0, 0.02, 0.1]))
        yield module.GoodputPolicy(min_gain), (survival, ceilings, base, pricer, kw)


def goodput_decisions(seed: int, module=new):
    """The decisions of ``module``'s ``GoodputPolicy`` on one seed's random cases."""
    for policy, (survival, ceilings, base, pricer, kw) in goodput_cases(seed, module):
        yield policy.decide(survival.copy(), ceilings.copy(), base, pricer, **kw)


def drafting_rate(policy, args, plan) -> float:
    """What the argmax maximises, for a drafting ``plan``: its expected tokens per
    second of decode work plus what it owes per token (``_best_plan``)."""
    survival, ceilings, base, pricer, kw = args
    batch, width = survival.shape
    pr = policy.prices(batch, width, base, pricer, **kw)
    n = int(plan.k.sum())
    ratio = pr.ratios(n + 1)[plan.k_step, n]
    seconds = max((pr.by_n[n] + (plan.k_step - 1) * pr.draft_pass) * ratio, 1e-12)
    tokens = batch + sum(survival[r, :k].sum() for r, k in enumerate(plan.k.tolist()))
    return tokens / (seconds + pr.owed * tokens)


@pytest.mark.parametrize("seed", GOODPUT_SEEDS)
def test_goodput_decide_matches_reference(seed, recorded):
    want = unpack(recorded, "goodput")[seed * GOODPUT_CASES:(seed + 1) * GOODPUT_CASES]
    ties = 0
    for case, (policy, args) in enumerate(goodput_cases(seed)):
        survival, ceilings, base, pricer, kw = args
        got = policy.decide(survival.copy(), ceilings.copy(), base, pricer, **kw)
        w = want[case]
        if (got.k_step and w.k_step and not np.array_equal(got.k, w.k)
                and math.isclose(drafting_rate(policy, args, got), drafting_rate(policy, args, w),
                                 rel_tol=1e-12)):
            # An exact tie (a profile proportional to tokens, every slot
            # certain, one clipped ratio: each plan the same rate to the
            # last bits), which the two implementations' rounding breaks
            # differently: both plans are the argmax.
            ties += 1
            continue
        assert_same(got, w, f"seed {seed} case {case}")
    assert ties <= 1, ties


@pytest.mark.parametrize("seed", range(10))
def test_a_probes_hopeful_plan_is_the_plan_of_the_hopeful_survival(seed):
    """``decide_hoping`` re-uses the last decision's sorted candidates; it must
    decide as ``decide_priced`` on the survival with the due rows replaced
    (ties included: coarse survivals and hopes equal to other rows' values)."""
    rng = np.random.default_rng(500 + seed)
    for case in range(100):
        survival, ceilings, base, kw = random_decide_args(rng)
        batch, width = survival.shape
        pricer = random_pricer(rng)
        policy = new.GoodputPolicy(float(rng.choice([0.0, 0.02])))
        prices = policy.prices(batch, width, base, pricer, **kw)
        policy.decide_priced(survival, ceilings, prices)
        due = rng.random(batch) < rng.choice([0.05, 0.5, 1.0])
        hope = (rng.choice([0.9, 0.75, 0.5]) ** np.arange(1.0, width + 1))
        got = policy.decide_hoping(survival, ceilings, due, hope, prices)
        hopeful = survival.copy()
        hopeful[due] = hope
        want = new.GoodputPolicy(policy.min_gain).decide_priced(hopeful, ceilings, prices)
        assert_same(got, want, f"seed {seed} case {case}")


def _drive(ctrl, rng_seed: int, steps: int, max_k: int, pinned: bool, usable_drafts=False):
    """Random traffic through one controller; yields its decisions.

    ``usable_drafts``: the request's caps given as the drafts it can use
    (the reference's ``caps``), not as the tokens it has left."""
    rng = np.random.default_rng(rng_seed)
    alive: list[str] = []
    nid = 0
    alphas: dict[str, float] = {}
    previous: dict[str, int] = {}
    last = None
    for step in range(steps):
        # Arrivals and departures.
        for _ in range(int(rng.poisson(2.0 if len(alive) < 40 else 0.5))):
            rid = f"r{nid}"
            nid += 1
            ctrl.add_request(rid, None if rng.random() < 0.7 else int(rng.integers(0, max_k + 1)))
            alive.append(rid)
            alphas[rid] = float(rng.uniform(0.05, 0.99))
        for rid in list(alive):
            if rng.random() < 0.03:
                alive.remove(rid)
                ctrl.finish_request(rid)
        if not alive:
            continue
        batch = list(alive) if rng.random() < 0.9 else list(rng.permutation(alive))
        # Learning from the previous plan's drafts: the planned batch, or the
        # requests that drafted (some finished since).
        ids = last if last is not None and rng.random() < 0.5 else [
            r for r in batch if previous.get(r, 0) > 0]
        drafted = [previous.get(r, 0) for r in ids]
        accepted = [min(int(rng.geometric(1.0 - alphas[r])) - 1, d) for r, d in zip(ids, drafted)]
        ctrl.observe_verifications(ids, drafted, accepted)
        tokens = len(batch) + sum(drafted)
        ctrl.observe_step(len(batch), tokens, int(rng.integers(0, max_k + 1)),
                          float(rng.uniform(1e-3, 50e-3)),
                          int(rng.integers(0, 64)) if rng.random() < 0.2 else 0)
        kw = {}
        if rng.random() < 0.3:
            kw["base_tokens"] = len(batch) + int(rng.integers(0, 1024))
        if rng.random() < 0.4:
            # The reference takes the usable drafts, the new one the tokens left.
            caps = rng.integers(0, 3 * max_k + 2, len(batch))
            if usable_drafts:
                kw["caps"] = caps.tolist()
            else:
                kw["tokens_left"] = (caps + 2).tolist()
        if rng.random() < 0.3:
            kw["catchup_tokens"] = int(rng.integers(0, 256))
            kw["catchup_if_plain"] = kw["catchup_tokens"] + int(rng.integers(0, 16))
        if pinned:
            kw["fixed_k_step"] = int(rng.integers(0, max_k + 1))
        probes = ctrl.stats.probes_sent
        d = ctrl.plan(batch, **kw)
        previous = dict(zip(batch, d.k.tolist()))
        last = batch
        yield step, d, ctrl.stats.probes_sent > probes


def traffic(seed: int, module=new):
    """A controller of ``module`` under one seed's random traffic: its
    decisions, whether each sent probes, and its counters at the end."""
    rng = np.random.default_rng(1000 + seed)
    max_k = int(rng.integers(1, 11))
    d = random_profile_dict(rng)
    settings = {"max_k": max_k, "min_gain": float(rng.choice([0.0, 0.02])),
                "probe_interval": int(rng.integers(1, 6)), "probe_k": int(rng.integers(1, 3)),
                "profile_correction": bool(rng.random() < 0.8)}
    pinned = bool(rng.random() < 0.25)
    ctrl = module.SpecController(module.ControllerSettings(**settings),
                                 module.StepProfile.from_dict(d))
    steps = list(_drive(ctrl, seed, TRAFFIC_STEPS, max_k, pinned, usable_drafts=module is not new))
    return steps, ctrl.stats


@pytest.mark.parametrize("seed", TRAFFIC_SEEDS)
def test_controller_traffic_matches_reference(seed, recorded):
    steps, stats = traffic(seed)
    at = recorded["traffic.seed_offsets"]
    decisions = unpack(recorded, "traffic")[at[seed]:at[seed + 1]]
    step_of, probes = recorded["traffic.step"][at[seed]:at[seed + 1]], \
        recorded["traffic.probed"][at[seed]:at[seed + 1]]
    assert len(steps) == len(decisions)
    for (step, got, _), want, want_step, probed in zip(steps, decisions, step_of, probes):
        assert step == want_step
        # A plan with probes is now priced as it is sent (the reference priced
        # the plan before its probes were added): the same plan, other predictions.
        assert_same(got, want, f"seed {seed} step {step}", priced=not probed)
        if probed:  # the probes' slots are counted
            assert got.predicted_tokens >= want.predicted_tokens
    for name, want in zip(STATS, recorded["traffic.stats"][seed]):
        assert getattr(stats, name) == want, name
    k_at = recorded["traffic.k_counts_offsets"]
    np.testing.assert_array_equal(stats.k_counts,
                                  recorded["traffic.k_counts"][k_at[seed]:k_at[seed + 1]])


def benchmark_traffic(batch: int, module=new):
    """The traffic of benchmarks/decision_cost.py (probes pending at 64) through
    a controller of ``module``: yields each step's decision, whether it sent
    probes and the seconds the step then took (its profile's price, noised)."""
    ctrl = module.SpecController(module.ControllerSettings(max_k=8),
                                 module.prior_profile("cuda", 0.025, batch * 9, batch))
    ids = [f"req-{i}" for i in range(batch)]
    rng = np.random.default_rng(batch)
    alphas = rng.uniform(0.1, 0.95, size=batch)
    previous = np.zeros(batch, dtype=np.int64)
    for _ in range(BENCHMARK_STEPS):
        probes = ctrl.stats.probes_sent
        d = ctrl.plan(ids)
        probed = ctrl.stats.probes_sent != probes
        accepted = np.minimum(rng.geometric(1.0 - alphas) - 1, previous)
        tokens = batch + int(previous.sum())
        seconds = ctrl.profile.step(tokens, batch, d.k_step) * rng.lognormal(0.0, 0.1)
        yield d, probed, seconds
        ctrl.observe_verifications(ids, previous, accepted)
        ctrl.observe_step(batch, tokens, d.k_step, seconds)
        previous = d.k.copy()


@pytest.mark.parametrize("batch", BENCHMARK_BATCHES)
def test_benchmark_traffic_matches_reference(batch, recorded):
    i = BENCHMARK_BATCHES.index(batch)
    span = slice(i * BENCHMARK_STEPS, (i + 1) * BENCHMARK_STEPS)
    want, want_seconds = unpack(recorded, "benchmark")[span], recorded["benchmark.seconds"][span]
    for step, (got, probed, seconds) in enumerate(benchmark_traffic(batch)):
        assert_same(got, want[step], f"step {step}", priced=not probed)
        assert _close(seconds, want_seconds[step]), f"step {step}"


def estimator_run(seed: int, module=new):
    """An estimator of ``module`` through random verifications, departures and
    prior-strength changes, then an underflowing product (no forgetting, huge
    histories): yields, a step at a time, the rows ``add`` gave, digests of the
    survival table and of conditional acceptance, and the prior strength; last,
    the digest of the underflow's conditional acceptance."""
    rng = np.random.default_rng(2000 + seed)
    width = int(rng.integers(1, 11))
    kw = {"forgetting": float(rng.choice([0.5, 0.85, 1.0])),
          "prior_strength": float(rng.choice([0.5, 2.0, 8.0])),
          "initial_acceptance": float(rng.uniform(0.2, 0.9)), "initial_capacity": 4}
    est = module.AcceptanceEstimator(width, **kw)
    ids: list[str] = []
    for step in range(ESTIMATOR_STEPS):
        added = []
        for _ in range(int(rng.poisson(1.0))):
            ids.append(f"r{step}-{len(ids)}")
            added.append(est.add(ids[-1]))
        if ids and rng.random() < 0.1:
            est.remove(ids.pop(int(rng.integers(len(ids)))))
        if not ids:
            yield added, None
            continue
        rows = np.array([est.row(r) for r in ids], dtype=np.intp)
        est.observe_rows(rows, rng.integers(0, width + 3, rows.size),
                         rng.integers(-1, width + 3, rows.size))
        yield added, (digest(est.survival(rows)), digest(est.conditional(rows)),
                      est.prior_strength)
    # Underflow: the closed form gives way to the loop.
    trials = 1e30 * rng.uniform(1, 2, (est.capacity, width))
    successes = trials * rng.uniform(0, 1, (est.capacity, width))
    est._counts[:, 1], est._counts[:, 0] = trials, successes
    yield None, digest(est.conditional(np.arange(est.capacity, dtype=np.intp)))


def estimator_steps(seed: int, module=new) -> list:
    """``estimator_run`` as JSON reads it back (the recorded file's form)."""
    return json.loads(json.dumps(list(estimator_run(seed, module))))


@pytest.mark.parametrize("seed", ESTIMATOR_SEEDS)
def test_estimator_matches_reference(seed, recorded):
    """Survival tables and conditional acceptance, bit for bit, through random
    verifications, departures and prior-strength changes; and the recurrence's
    loop for an underflowing product (no forgetting, huge histories)."""
    want = json.loads(str(recorded["estimator"]))[seed]
    got = estimator_steps(seed)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"step {step}"


@pytest.mark.parametrize("seed", range(4))
def test_candidate_order_is_a_stable_sort(seed):
    """The slots in the order the reference sorts them (``argsort(-s, kind="stable")``),
    on both of the sort's paths: spread survivals and clustered ones."""
    from vllm_specplug.controller.argmax import _candidates

    rng = np.random.default_rng(3000 + seed)
    for _ in range(200):
        batch, width = int(rng.integers(1, 700)), int(rng.integers(1, 11))
        survival = random_survival(rng, batch, width)
        if rng.random() < 0.3:
            survival = 0.5 + 1e-9 * rng.random((batch, width))
        ceilings = rng.integers(0, width + 2, batch)
        vals, rows, at, deepest = _candidates(survival, ceilings)
        pos = np.arange(width)[None, :]
        keep = (survival > 0.0) & (pos < ceilings[:, None])
        r, p = np.nonzero(keep)
        order = np.argsort(-survival[keep], kind="stable")
        np.testing.assert_array_equal(vals, survival[keep][order])
        np.testing.assert_array_equal(rows, r[order])
        np.testing.assert_array_equal(at, p[order])
        assert deepest == (p.max() if p.size else 0)
