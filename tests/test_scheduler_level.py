"""The adapter against vLLM's real ``Scheduler`` and ``AsyncScheduler``: plan and observe.

No model runs: a synthetic runner (``scheduler_driver.SyntheticRun``) answers every
scheduled step with a ``ModelRunnerOutput`` whose accepted-draft counts follow a
per-request rule (always accept, never accept, ...), and, like vLLM's proposer, drafts
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

Sessions, the async soak, the workers' skip reports and unchecked runners:
``test_scheduler_lifecycle.py``.
"""

import math

from conftest import CEILING
from scheduler_driver import SyntheticRun, always, build_scheduler, never
from vllm_specplug.tools.testing import make_request


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
    assert not sp.zero_cost.on
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


def test_the_decision_trace_records_each_plan_with_the_survival_it_read(tiny_models, tmp_path):
    """The trace's plan records come from the plan alone (its survival rows), with
    no fault: good drafts' first-draft acceptance ends high, bad ones' low."""
    from vllm_specplug.tools.trace_report import read_trace

    path = tmp_path / "trace.jsonl"
    sched = build_scheduler(tiny_models["target"], False, specplug={"trace_path": str(path)})
    accepts = {f"r{i}": always if i % 2 == 0 else never for i in range(4)}
    for rid in accepts:
        sched.add_request(make_request(rid, 40))
    SyntheticRun(sched, accepts).run()
    sched.specplug.trace.close()
    assert sched.specplug.faults == 0
    plans = [r for r in read_trace(str(path)) if r["event"] == "plan" and r["requests"]]
    assert plans
    for p in plans:
        for x in p["requests"].values():
            assert 0.0 <= x["acceptance"] <= 1.0 and 0.0 <= x["expected"] <= x["k"] + 1e-9
    last = {}
    for p in plans:
        last.update({rid: x["acceptance"] for rid, x in p["requests"].items()})
    assert min(last["r0"], last["r2"]) > 0.8 and max(last["r1"], last["r3"]) < 0.3, last
