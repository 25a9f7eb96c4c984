"""The adapter against vLLM's real ``Scheduler`` and ``AsyncScheduler``.

No model runs: a synthetic runner answers every scheduled step with a
``ModelRunnerOutput`` whose accepted-draft counts follow a per-request rule
(always accept, never accept, ...), and, like vLLM's proposer, drafts
``num_spec_tokens_to_schedule`` tokens for every decoding request.  In
async mode the engine's order is kept: step t+1 is scheduled before the
output of step t is processed, and drafts travel as placeholders.

Checked every step, for both schedulers (``../shared/design.md``):
- ``num_spec_tokens_to_schedule`` (K_step) never exceeds the ceiling;
- a request never gets more drafts than the controller planned for it, and
  the plan never exceeds K_step or the request's own ceiling;
- async placeholders are sized to the request's own k, not to K_step;
- every request produces exactly ``max_tokens`` tokens (accounting with
  variable drafts stays right), and controller state is freed at the end.
"""

import math

import pytest

from conftest import CEILING
from vllm_specplug.tools.testing import SAMPLED_TOKEN as TOKEN
from vllm_specplug.tools.testing import FakeEngine, make_request


def clock_profile():
    """The synthetic clock's step costs (``FakeEngine.advance``), in its units.

    A plain step costs 10 + 1 a token, the draft's first pass 0.5 + 0.1 a
    token, each further draft position 0.5 + 0.1 a request, a catch-up 0.5 +
    0.1 a skipped token: a draft a tenth the target's size.  Speculation
    pays for drafts that are accepted (perfect drafts at K=4 for half a
    batch of 8: about 1.3x plain), and a wasted draft costs about a tenth
    of a decode step.  The controller prices steps with this same profile,
    so what it learns online is acceptance (and the correction, from
    garbage timings).
    """
    from vllm_specplug.controller import StepProfile

    tokens, batch = [1.0, 16.0, 256.0], [1.0, 16.0]
    return StepProfile(tokens, [10.0 + t for t in tokens], [0.5 + 0.1 * t for t in tokens],
                       batch, [0.5 + 0.1 * b for b in batch],
                       catchup_tokens=tokens, catchup_s=[0.5 + 0.1 * t for t in tokens],
                       meta={"source": "test_scheduler_level clock"})


def build_scheduler(model, async_scheduling, specplug=None, method="draft_model",
                    data_parallel_size=1, num_blocks=256):
    """The plugin's scheduler, its controller pricing with ``clock_profile``."""
    from vllm_specplug.controller import SpecController
    from vllm_specplug.tools.testing import build_scheduler as build

    sched = build(model, CEILING, method=method, async_scheduling=async_scheduling,
                  specplug=specplug, data_parallel_size=data_parallel_size,
                  num_blocks=num_blocks)
    sp = sched.specplug
    if sp.enabled:
        sp.controller = SpecController(sp.controller.settings, clock_profile())
    return sched


class SyntheticRun(FakeEngine):
    """``FakeEngine`` on the plugin's scheduler, checking every step.

    A synthetic clock: each step takes clock_profile()'s price of what it
    ran.  The controller is given that profile (build_scheduler): with the
    target as its own draft (what the config says) a real profile would
    price draft passes like target passes, which this clock does not charge.
    """

    def __init__(self, sched, accepts):
        super().__init__(sched, accepts, clock_profile())
        self.drafts_seen: dict[str, list[int]] = {}
        self.produced: dict[str, int] = {}  # tokens each request yielded
        self.preempted = 0
        self.planned_seen: dict[str, list[int]] = {}
        self.given = [0, 0]  # drafts this runner verified, and accepted
        self.decided = None  # the K_step of the plan of the step just scheduled
        sp = sched.specplug
        if sp.enabled:
            plan = sp.controller.plan

            def recorded(*args, **kwargs):
                self.decided = None
                decision = plan(*args, **kwargs)
                self.decided = min(int(decision.k_step), sp.num_spec_tokens)
                return decision

            sp.controller.plan = recorded

    def update(self, so, out):
        self.preempted += len(getattr(so, "preempted_req_ids", None) or ())
        self.count_given(so, out)
        outputs = super().update(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                self.produced[o.request_id] = (self.produced.get(o.request_id, 0)
                                               + len(o.new_token_ids))
        return outputs

    def count_given(self, so, out):
        """Drafts this runner verified and accepted, for requests still live
        when their output arrives (vLLM drops a finished request's output)."""
        row = {rid: i for i, rid in enumerate(out.req_ids)}
        for rid, spec in so.scheduled_spec_decode_tokens.items():
            # V1 with synchronous scheduling pads with -1 where no draft was
            # made; V2 and async scheduling send -1 placeholders for real ones.
            if not spec or (spec[0] == -1 and not (self.is_async or self.v2)):
                continue
            request = self.sched.requests.get(rid)
            sampled = out.sampled_token_ids[row[rid]]
            if sampled and request is not None and not request.is_finished():
                self.given[0] += len(spec)
                self.given[1] += len(sampled) - 1

    def check(self, so):
        sp = self.sched.specplug
        if sp.faults == 0 and self.decided is not None and not sp.k_step_pinned:
            # K_step sent to the workers is the plan's.
            assert so.num_spec_tokens_to_schedule == self.decided
        # Drafts verified in this step were planned when the previous step
        # was scheduled (sync: trimmed to k_r; async: placeholders of k_r).
        for rid in so.num_scheduled_tokens:
            if self.sched.requests[rid].is_prefill_chunk:
                continue
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            self.drafts_seen.setdefault(rid, []).append(len(spec))
            previous = self.planned_seen.get(rid)
            if spec and previous and not (spec[0] == -1 and not self.is_async):
                assert len(spec) <= previous[-1], (rid, len(spec), previous[-1])
        k_step = so.num_spec_tokens_to_schedule
        assert 0 <= k_step <= CEILING
        for rid, k in sp.planned.items():
            assert 0 <= k <= k_step, (rid, k, k_step)
            req = self.sched.requests[rid]
            ceiling = (req.sampling_params.extra_args or {}).get("specplug_max_k", CEILING)
            assert k <= ceiling
            self.planned_seen.setdefault(rid, []).append(k)
            if self.is_async:
                assert len(req.spec_token_ids) == k, "placeholders not sized to k_r"
        # A step whose planning failed runs vLLM's own K for every request.
        for rid in so.num_scheduled_tokens:
            if rid not in sp.planned and not self.sched.requests[rid].is_prefill_chunk:
                self.planned_seen.setdefault(rid, []).append(k_step)

    def run(self, max_steps=400):
        while (self.sched.has_requests() or self.pending is not None) and self.steps < max_steps:
            self.step()
        if self.pending is not None:
            self.update(*self.pending)
            self.pending = None
        assert not self.sched.has_requests(), "requests did not finish"


def always(n):
    return n


def never(n):
    return 0


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    return request.param


def test_invariants_mixed_batch(tiny_models, async_scheduling):
    sched = build_scheduler(tiny_models["target"], async_scheduling)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    assert isinstance(sched, AsyncScheduler) == async_scheduling
    accepts, max_tokens = {}, {}
    for i in range(8):
        rid = f"r{i}"
        ceiling = 0 if i == 6 else (2 if i == 7 else None)
        sched.add_request(make_request(rid, 60, ceiling))
        accepts[rid] = always if i % 2 == 0 else never
        max_tokens[rid] = 60
    run = SyntheticRun(sched, accepts)
    run.run()
    assert run.produced == max_tokens, "token accounting broken by variable drafts"
    # Good requests climb to the ceiling; bad ones fall back to (almost) nothing.
    good = [d for i in (0, 2, 4) for d in run.drafts_seen[f"r{i}"][-6:]]
    bad = [d for i in (1, 3, 5) for d in run.drafts_seen[f"r{i}"][-30:]]
    assert sum(good) / len(good) >= CEILING - 0.5, run.drafts_seen
    assert sum(bad) / max(len(bad), 1) <= 0.5, run.drafts_seen
    assert max(run.drafts_seen.get("r6", [0])) == 0, "ceiling 0 drafted"
    assert max(run.drafts_seen["r7"]) <= 2, "per-request ceiling exceeded"
    sp = sched.specplug
    assert sp.controller.num_requests() == 0 and not sp.planned
    assert sp.controller.stats.drafted > 0 and sp.controller.pricer.correction.observations > 0
    # What the controller learnt is what the runner verified and accepted.
    stats = sp.controller.stats
    assert [stats.drafted, stats.accepted] == run.given, (stats, run.given)


def test_fault_in_controller_keeps_vllm_behaviour(tiny_models, async_scheduling):
    sched = build_scheduler(tiny_models["target"], async_scheduling)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 30))

    def broken(*a, **k):
        raise RuntimeError("injected")

    sched.specplug.controller.plan = broken
    run = SyntheticRun(sched, {f"r{i}": always for i in range(4)})
    run.run()
    assert sched.specplug.faults > 0
    # vLLM's own K (the ceiling) was used for every step.
    assert max(d for v in run.drafts_seen.values() for d in v) == CEILING


def test_a_failure_after_planning_leaves_a_consistent_plan(tiny_models, async_scheduling):
    # The trace (I/O after the decision) fails every step: the plan is still
    # applied whole, vLLM's K_step and the async placeholders agree with it
    # (SyntheticRun.check), and a failing controller call at request end is
    # counted, not raised.
    sched = build_scheduler(tiny_models["target"], async_scheduling)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 30))

    class BrokenTrace:
        def plan(self, *a, **k):
            raise OSError("disk full")

        def verify(self, *a, **k):
            pass

        def close(self):
            pass

    sched.specplug.trace = BrokenTrace()
    finish = sched.specplug.controller.finish_request

    def broken_finish(rid):
        finish(rid)
        raise RuntimeError("injected")

    sched.specplug.controller.finish_request = broken_finish
    run = SyntheticRun(sched, {f"r{i}": always for i in range(4)})
    run.run()
    sp = sched.specplug
    assert sp.faults >= run.steps // 2
    # The adaptive plan ran (the good drafts climbed), not vLLM's fallback K.
    assert sp.controller.stats.drafted > 0
    assert not sp.planned or all(k <= CEILING for k in sp.planned.values())


def test_static_policy_pins_k(tiny_models, async_scheduling):
    sched = build_scheduler(tiny_models["target"], async_scheduling,
                            specplug={"policy": "static", "static_k": 2})
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 30))
    run = SyntheticRun(sched, {f"r{i}": never for i in range(3)})
    run.run()
    # (The last steps of a request offer no more drafts than it has tokens
    # left before max_tokens.)
    seen = {d for v in run.drafts_seen.values() for d in v[1:-3]}
    assert seen <= {0, 2} and 2 in seen
    assert max(d for v in run.drafts_seen.values() for d in v) <= 2


def test_lockstep_data_parallel_pins_k_step_and_adapts_per_request(tiny_models,
                                                                    async_scheduling):
    """DP ranks that step in lockstep run collectives in every draft pass: all
    must run the same K_step (vLLM's num_speculative_tokens), every step, or
    they hang.  Per-request k still adapts under it."""
    sched = build_scheduler(tiny_models["target"], async_scheduling, data_parallel_size=2)
    sp = sched.specplug
    assert sp.enabled and sp.k_step_pinned and "data_parallel_size" in sp.pin_reason
    assert not sp.zero_cost_fallback
    k_steps = []
    orig = sched.schedule

    def recording():
        so = orig()
        if so.total_num_scheduled_tokens:
            k_steps.append(so.num_spec_tokens_to_schedule)
        return so

    sched.schedule = recording
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 60))
    run = SyntheticRun(sched, {f"r{i}": always if i < 3 else never for i in range(6)})
    run.run()
    assert set(k_steps) == {CEILING}, "K_step moved under lockstep DP"
    good = [d for i in range(3) for d in run.drafts_seen[f"r{i}"][-6:]]
    bad = [d for i in range(3, 6) for d in run.drafts_seen[f"r{i}"][-30:]]
    assert sum(good) / len(good) >= CEILING - 0.5, run.drafts_seen
    assert sum(bad) / len(bad) <= 0.5, run.drafts_seen


def test_fallback_and_recovery_through_probes(tiny_models, async_scheduling):
    """Drafts rejected for a while, then accepted: the request falls back,
    probes with back-off, and climbs back to the ceiling once a probe is
    accepted.  Step counts are printed for the record (``pytest -s``)."""
    sched = build_scheduler(tiny_models["target"], async_scheduling)
    turn_at = 40  # decode steps of rejection before drafts turn good
    verifications = {"n": 0}

    def flipping(n):
        verifications["n"] += 1
        return 0 if run.steps < turn_at else n

    for i in range(4):
        sched.add_request(make_request(f"r{i}", 200))
    # Every request flips: nobody keeps the proposer running, so only probes
    # can bring speculation back.
    run = SyntheticRun(sched, {f"r{i}": flipping for i in range(4)})
    run.run()
    seen = run.drafts_seen["r0"]
    # Index of the first decode step at or after the flip.
    flip = next(i for i in range(len(seen)) if i + 2 >= turn_at)
    fallback_at = next(i for i in range(1, flip) if seen[i] == 0 and max(seen[i:flip]) <= 1)
    recovered_at = next(i for i in range(flip, len(seen)) if seen[i] >= CEILING)
    stats = sched.specplug.controller.stats
    print(f"\n{'async' if async_scheduling else 'sync'}: fell back after {fallback_at} decode "
          f"steps, recovered to K={CEILING} {recovered_at - flip} steps after drafts turned "
          f"good; probes sent {stats.probes_sent}, succeeded {stats.probes_succeeded}")
    assert fallback_at <= 10
    # Recovery waits for the next probe (back-off up to probe_max_interval),
    # then a few doubling probes, no longer than the policy would grant good
    # drafts (3 here), and the policy's own climb to the ceiling.  Measured:
    # 31 steps sync, 46 async (37 when probes doubled up to the ceiling).
    max_interval = sched.specplug.controller.settings.probe_max_interval
    assert recovered_at - flip <= max_interval + 20
    assert stats.probes_succeeded >= 1 and stats.recoveries >= 1


def test_garbage_timings_do_not_destabilise_k(tiny_models, async_scheduling):
    """A clock that jumps backwards, stalls or leaps hours now and then: the
    correction drops the garbage and moves a step per outlier at most, and
    good requests keep K."""
    sched = build_scheduler(tiny_models["target"], async_scheduling)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 160))
    run = SyntheticRun(sched, {f"r{i}": always for i in range(4)})
    clean = sched.specplug.clock
    calls = {"n": 0}

    def garbage():
        calls["n"] += 1
        t = clean()
        if calls["n"] % 7 == 0:
            return t - 1e6       # backwards: a negative step
        if calls["n"] % 11 == 0:
            return t + 3600.0    # an hour-long stall
        if calls["n"] % 13 == 0:
            return float("nan")
        return t

    sched.specplug.clock = garbage
    ctrl = sched.specplug.controller
    kept = []
    observe_step = ctrl.observe_step
    ctrl.observe_step = lambda *a, **kw: kept.append(observe_step(*a, **kw)) or kept[-1]
    run.run()
    seen = run.drafts_seen["r0"]
    late = seen[len(seen) // 3:]
    # Never knocked into fallback, at the ceiling at the end.
    assert 0 not in late, seen
    assert sum(late) / len(late) >= CEILING - 0.5, seen
    assert seen[-4:] == [CEILING] * 4, seen
    assert sched.specplug.faults == 0
    assert kept.count(False) > 0 and kept.count(True) > kept.count(False), kept
    # The stalls moved the profile's price by a few correction steps, no more.
    corr = ctrl.pricer.correction
    assert abs(math.log(corr.ratio(4 + 4 * CEILING, 4))) <= 5 * corr.step


def test_drafts_structured_output_rejects_are_not_learnt_as_rejections(tiny_models):
    """Async scheduling with structured output: drafts against the grammar
    are padded with -1 before verification (``num_invalid_spec_tokens``) and
    never offered.  vLLM leaves them out of its counts; so must the controller,
    or a good draft under a strict grammar looks bad and loses its drafts."""
    sched = build_scheduler(tiny_models["target"], True)
    sched.add_request(make_request("a", 80))
    # The grammar allows each step's first draft only, and the draft is right.
    run = SyntheticRun(sched, {"a": lambda n: 1})
    marked, seen = [], []
    make_output = run.model_output

    def grammar(so):
        for rid, spec in so.scheduled_spec_decode_tokens.items():
            if len(spec) > 1:
                spec[1:] = [-1] * (len(spec) - 1)
                so.num_invalid_spec_tokens = {**(so.num_invalid_spec_tokens or {}),
                                              rid: len(spec) - 1}
                marked.append(len(spec) - 1)
        return make_output(so)

    run.model_output = grammar
    ctrl = sched.specplug.controller
    observe = ctrl.observe_verifications

    def spy(rids, drafted, accepted):
        seen.extend(zip(drafted, accepted))
        return observe(rids, drafted, accepted)

    ctrl.observe_verifications = spy
    run.run()
    assert marked, "no step offered more than one draft: nothing was checked"
    assert seen and all(d == a == 1 for d, a in seen), seen


def test_the_scheduler_believes_what_the_workers_report_about_skipping(tiny_models):
    # Zero-cost fallback: each step's output tells the scheduler whether the
    # worker skips the draft at K_step = 0 (patches/draft_model_skip.py).
    # When a worker gives up (a failed catch-up), K_step = 0 steps are priced
    # with the draft's first pass from then on, no catch-up is owed, and the
    # requests that skipped steps learn their acceptance anew.
    from vllm_specplug.deployment import ZERO_COST_OUTPUT_ATTR

    sched = build_scheduler(tiny_models["target"], False)
    sp = sched.specplug
    if sp.k_step_pinned:  # vLLM 0.33's V2 draft_model: no K_step = 0 step to skip
        pytest.skip(f"K_step is pinned here ({sp.pin_reason})")
    # build_scheduler's engine config does not name the plugin's scheduler,
    # so the config's answer is no; here it promised skipping.
    sp.zero_cost_fallback = True
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 80))
    run = SyntheticRun(sched, {f"r{i}": never for i in range(3)})
    report = {"on": True}
    plain_output = run.model_output

    def reporting(so):
        out = plain_output(so)
        setattr(out, ZERO_COST_OUTPUT_ATTR, report["on"])
        return out

    run.model_output = reporting
    for _ in range(30):
        run.step()
    assert sp.zero_cost_fallback  # the worker said what the config says: nothing changes
    skipped = sorted(sp.stale_from)
    assert skipped, "the rejected drafts should have put the batch in fallback"
    rows = [sp.controller.estimator.row(r) for r in skipped]
    assert sp.controller.estimator._counts[rows].sum() > 0
    report["on"] = False
    run.step()
    assert sp.controller.estimator._counts[rows].sum() == 0  # learnt anew
    assert not sp.zero_cost_fallback and not sp.stale_from and not sp.catchup
    assert sp.controller.profile.meta.get("zero_cost_fallback") is False
    assert sp.controller.profile.first(4.0) == 0.0  # the first pass is in every step now
    assert sp.controller.profile.target(4.0) == pytest.approx(
        clock_profile().target(4.0) + clock_profile().first(4.0))
    run.run()
    assert not sp.stale_from  # nothing more is counted as skipped
    assert sp.faults == 0


def test_a_soak_of_the_async_scheduler(tiny_models):
    """Many requests through vLLM's ``AsyncScheduler``, as on GPUs.

    The engine soak (``test_soak.py``) runs the sync scheduler: the CPU build
    turns async scheduling off.  Here 600 requests arrive over time, up to 8
    at once, with random lengths, ceilings (0 included) and acceptance; one
    in 25 is aborted midway; the KV cache holds about half of what they
    want, so requests are preempted and resumed (vLLM pads their drafts with
    ``-1`` placeholders); the zero-cost fallback's bookkeeping is on; and
    every 7th per-step controller call raises.  Every step keeps the
    invariants (``SyntheticRun.check``: placeholders sized to k_r, k_r <=
    K_step <= ceiling); every request that was not aborted yields exactly
    ``max_tokens``; every fault is absorbed and counted; nothing is left in
    the controller or the adapter at the end.  The traffic is seeded, but
    the exact interleaving follows Python's hash seed (vLLM iterates sets of
    request ids): the assertions hold for any.
    """
    import random

    from soak_scheduler import inject_faults
    from vllm.v1.request import RequestStatus

    sched = build_scheduler(tiny_models["target"], True, num_blocks=24)
    sp = sched.specplug
    assert sp.is_async
    sp.zero_cost_fallback = True
    calls = inject_faults(sp.controller, 7)
    rng = random.Random(29)

    def half(rid):
        own = random.Random(rid)  # not the shared stream: step order must not change draws
        return lambda n: own.randint(0, n)

    rules = {"always": lambda rid: always, "never": lambda rid: never, "half": half}
    accepts, max_tokens, aborted, live = {}, {}, set(), set()
    run = SyntheticRun(sched, accepts)
    total, sent = 600, 0
    while sent < total or sched.has_requests() or run.pending is not None:
        while len(live) < 8 and sent < total and rng.random() < 0.5:
            rid = f"s{sent}"
            ceiling = rng.choice([None, None, 0, 1, 2, CEILING])
            max_tokens[rid] = rng.randint(2, 60)
            accepts[rid] = rules[rng.choice(list(rules))](rid)
            sched.add_request(make_request(rid, max_tokens[rid], ceiling,
                                           prompt_len=rng.randint(3, 90)))
            live.add(rid)
            sent += 1
        run.step()
        live = {r for r in live if r in sched.requests}
        if live and rng.random() < 0.04:
            rid = rng.choice(sorted(live))
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        assert run.steps < 40 * total, "requests hung"
    if run.pending is not None:
        run.update(*run.pending)
    print(f"\nasync soak: {total} requests, {len(aborted)} aborted, {run.preempted} "
          f"preemptions, {sp.faults} faults, {run.steps} steps")
    produced = run.produced
    finished = {r: n for r, n in max_tokens.items() if r not in aborted}
    assert {r: produced.get(r, 0) for r in finished} == finished
    assert all(produced.get(r, 0) <= max_tokens[r] for r in aborted)
    assert len(aborted) >= 10 and run.preempted >= 10, (len(aborted), run.preempted)
    assert sp.faults == calls[0] // 7 >= 50, (sp.faults, calls)
    assert sp.controller.stats.drafted > 0 and sp.controller.stats.probes_sent > 0
    assert sp.controller.num_requests() == 0 and sp.controller.num_in_fallback() == 0
    assert not sp.planned and not sp.stale_from and not sched.requests


def _session_request(req_id, max_tokens, ceiling=None, resumable=True):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = None if ceiling is None else {"specplug_max_k": ceiling}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)
    return Request(req_id, [TOKEN + (i % 5) for i in range(12)], params, None,
                   resumable=resumable)


def test_a_streaming_input_session_takes_its_updates_ceiling_and_frees_its_row(tiny_models):
    """A streaming-input session (vLLM's resumable requests): each chunk's
    ``specplug_max_k`` applies when the chunk does, and the session's end
    (vLLM finishes it inside ``add_request``) leaves no controller row."""
    from vllm.v1.request import RequestStatus

    sched = build_scheduler(tiny_models["target"], False)
    ctrl = sched.specplug.controller
    run = SyntheticRun(sched, {"s": always})

    def ceiling():
        return ctrl.ceiling("s")

    sched.add_request(_session_request("s", 8, ceiling=3))
    assert ctrl.num_requests() == 1 and ceiling() == 3
    for _ in range(40):
        if sched.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        run.step()
    assert sched.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert ctrl.num_requests() == 1  # a paused session keeps its row
    # The next chunk asks for at most one draft.
    sched.add_request(_session_request("s", 8, ceiling=1))
    assert ctrl.num_requests() == 1 and ceiling() == 1
    for _ in range(40):
        if sched.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        run.step()
        assert all(k <= 1 for k in sched.specplug.planned.values())
    # A chunk without the key takes the server's ceiling again.
    sched.add_request(_session_request("s", 4))
    assert ceiling() == CEILING
    for _ in range(40):
        if sched.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        run.step()
    # The end of the session: vLLM finishes it inside add_request.
    sched.add_request(_session_request("s", 1, resumable=False))
    assert "s" not in sched.requests
    assert ctrl.num_requests() == 0


def test_on_a_runner_it_was_not_checked_against_it_behaves_exactly_as_vllm(
        tiny_models, monkeypatch, caplog):
    """A platform other than CPU or CUDA: one warning, and vLLM's own K every
    step (nothing planned, nothing trimmed)."""
    from vllm_specplug import runners

    monkeypatch.setattr(runners, "model_runner_name", lambda vllm_config: "other")
    with caplog.at_level("WARNING", logger="vllm.specplug"):
        sched = build_scheduler(tiny_models["target"], False)
    sp = sched.specplug
    assert not sp.enabled
    assert "not one the plugin was checked against" in sp.reason
    assert "VLLM_USE_V2_MODEL_RUNNER" not in sp.reason
    assert sum("inert" in r.getMessage() for r in caplog.records) == 1
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 12))
    run = SyntheticRun(sched, {f"r{i}": never for i in range(3)})
    ks = []
    while sched.has_requests() and run.steps < 100:
        so = sched.schedule()
        ks.append(so.num_spec_tokens_to_schedule)
        if so.total_num_scheduled_tokens:
            run.update(so, run.model_output(so))
        run.steps += 1
    assert set(ks) == {CEILING}  # vLLM's K, every step


@pytest.mark.parametrize("runner,version,pinned", [
    ("cpu-v1", "0.32.0", False), ("gpu-v1", "0.33.0", False),
    ("gpu-v2", "0.32.0", True), ("gpu-v2", "0.33.0", True), ("gpu-v2", "0.34.0", False)])
def test_k_step_is_pinned_where_the_drafter_runs_every_position(monkeypatch, runner, version,
                                                                 pinned):
    """draft_model: vLLM 0.32-0.33's V2 speculator drafts every position
    whatever K_step says (the plugin adapts each request's k under the full
    K); V1, and 0.34's autoregressive speculator, draft K_step positions."""
    from types import SimpleNamespace

    from vllm_specplug import compat, runners
    from vllm_specplug.deployment import pin_reason

    monkeypatch.setattr(runners, "model_runner_name", lambda vllm_config: runner)
    monkeypatch.setattr(compat, "vllm_version", lambda: version)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"),
                          parallel_config=SimpleNamespace(data_parallel_size=1))
    why = pin_reason(cfg)
    assert (why is not None) == pinned, why
    if pinned:
        assert "drafts every position" in why


def test_a_users_batch_size_table_of_k_pins_k_step(monkeypatch):
    from types import SimpleNamespace

    from vllm_specplug import runners
    from vllm_specplug.deployment import pin_reason

    monkeypatch.setattr(runners, "model_runner_name", lambda vllm_config: "cpu-v1")

    def config(table=None, method="draft_model"):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(
                method=method, num_speculative_tokens_per_batch_size=table),
            parallel_config=SimpleNamespace(data_parallel_size=1))

    assert pin_reason(config()) is None
    assert "per_batch_size" in pin_reason(config([(1, 8, 4), (9, 64, 2)]))
    assert "needs a fixed K" in pin_reason(config(method="mtp"))
