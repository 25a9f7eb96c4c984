"""The adapter on vLLM's real schedulers, with the synthetic driver of
``test_scheduler_level.py`` (``scheduler_driver``): what the workers report
about skipping, a soak of the ``AsyncScheduler``, streaming-input sessions, and
a runner the plugin was not checked against.
"""

import pytest

from conftest import CEILING
from scheduler_driver import SyntheticRun, always, build_scheduler, clock_profile, never
from vllm_specplug.tools.testing import SAMPLED_TOKEN as TOKEN
from vllm_specplug.tools.testing import make_request


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
    sp.zero_cost.on = True
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
    assert sp.zero_cost.on  # the worker said what the config says: nothing changes
    skipped = sorted(sp.zero_cost.stale_from)
    assert skipped, "the rejected drafts should have put the batch in fallback"
    rows = [sp.controller.estimator.row(r) for r in skipped]
    assert sp.controller.estimator._counts[rows].sum() > 0
    report["on"] = False
    run.step()
    assert sp.controller.estimator._counts[rows].sum() == 0  # learnt anew
    assert not sp.zero_cost.on and not sp.zero_cost.stale_from and not sp.zero_cost.catchup
    assert sp.controller.profile.meta.get("zero_cost_fallback") is False
    assert sp.controller.profile.first(4.0) == 0.0  # the first pass is in every step now
    assert sp.controller.profile.target(4.0) == pytest.approx(
        clock_profile().target(4.0) + clock_profile().first(4.0))
    run.run()
    assert not sp.zero_cost.stale_from  # nothing more is counted as skipped
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
    sp.zero_cost.on = True
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
    assert not sp.planned and not sp.zero_cost.stale_from and not sched.requests


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
