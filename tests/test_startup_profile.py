"""The step-cost profile measured at engine start-up, on real vLLM (CPU, tiny models).

- the profile is measured before the scheduler exists, cached, and a second
  engine of the same deployment takes it from the cache after its check;
- ``profile: off`` and ``profile: PATH`` do what they say; a bad path stops
  start-up naming the key;
- the cold-start trap: on a fixed profile, the draft's first calls while
  serving are made 5x slower than it says, and a perfect draft still ends
  at the ceiling (the profile prices drafting; slow live steps only nudge
  its clipped correction).  Output equals plain decoding throughout.
"""

import json
import time

import pytest

from conftest import (CEILING, draft_model, drafted_per_step, drafter_of, greedy, make_llm,
                      plain_token_ids, scheduler_of, shutdown, token_ids)
from helpers import free_port, prompt

PROMPTS = [prompt(i) for i in range(3)]
LONG = 96


@pytest.fixture(scope="module")
def plain(tiny_models):
    return plain_token_ids(tiny_models["target"], PROMPTS, LONG)


@pytest.fixture
def profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SPECPLUG_PROFILE_CACHE", str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def test_profile_is_measured_at_start_up_cached_and_reused(tiny_models, plain, profile_cache,
                                                          monkeypatch):
    from vllm_specplug import profiling

    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"})
    try:
        prof = scheduler_of(llm).specplug.profile
        assert prof.meta["source"] == "measured"
        assert prof.meta["shapes"] >= 10 and prof.meta["seconds"] < 60
        # Batch sizes 1, 2, 4, ... up to max_num_seqs (16), token sizes B and B(1+K).
        assert list(prof.batch) == [1, 2, 4, 8, 16]
        assert {1, 1 + CEILING, 16, 16 * (1 + CEILING)} <= set(prof.tokens.tolist())
        assert (prof.target_s > 0).all() and (prof.pass_s >= 0).all()
        # Zero-cost fallback: the catch-up of skipped tokens was timed too.
        assert prof.catchup_tokens is not None and prof.catchup_tokens.size >= 1
        assert prof.meta["zero_cost_fallback"] is True
        files = list(profile_cache.glob("*.json"))
        assert len(files) == 1
        assert json.loads(files[0].read_text())["tokens"] == prof.tokens.tolist()
        # Every batch size's plain step was timed now: the live correction
        # counts them as seen (no plain probe), and the cache does not keep it.
        assert prof.meta["start_check"]["plain_batches"] == [1, 2, 4, 8, 16]
        assert "start_check" not in json.loads(files[0].read_text())["meta"]
        corr = scheduler_of(llm).specplug.controller.pricer.correction
        assert min(corr.plain_seen(b) for b in (1, 2, 4, 8, 16)) >= 1
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert token_ids(outs) == plain
    finally:
        shutdown(llm)
    # The same deployment again: the cached table, after its two-shape check
    # (whose verdict on millisecond steps depends on how busy the machine is,
    # so here it is told to pass; the next engine shows it can fail).
    monkeypatch.setattr(profiling.validation, "VALIDATE_TOLERANCE", 1e9)
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"})
    try:
        again = scheduler_of(llm).specplug.profile
        assert again.meta["measured_at"] == prof.meta["measured_at"]
        assert again.tokens.tolist() == prof.tokens.tolist()
        # The check timed one request's plain and drafting steps: the live
        # correction starts from its ratios, one request's plain step seen.
        check = again.meta["start_check"]
        assert check["plain_batches"] == [1] and check["plain"] > 0 and check["drafting"] > 0
        corr = scheduler_of(llm).specplug.controller.pricer.correction
        assert corr.learnt()["common"] == pytest.approx(min(max(check["drafting"], 0.5), 2.0),
                                                        abs=1e-3)
        assert corr.plain_seen(1) >= 1 and corr.plain_seen(4) == 0
    finally:
        shutdown(llm)
    # A cached table 1000x off this machine is measured again (and replaced).
    monkeypatch.setattr(profiling.validation, "VALIDATE_TOLERANCE", 0.25)
    wrong = json.loads(files[0].read_text())
    wrong["target_s"] = [t * 1000 for t in wrong["target_s"]]
    wrong["meta"]["measured_at"] = "wrong"
    files[0].write_text(json.dumps(wrong))
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"})
    try:
        fresh = scheduler_of(llm).specplug.profile
        assert fresh.meta["measured_at"] != "wrong"
        assert max(fresh.target_s) < min(wrong["target_s"]) / 10
        assert json.loads(files[0].read_text())["meta"]["measured_at"] == fresh.meta["measured_at"]
    finally:
        shutdown(llm)


def test_profile_off_and_profile_from_a_path(tiny_models, profile_cache, tmp_path):
    from vllm_specplug.controller import StepProfile

    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "off"})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "prior"
        assert not profile_cache.exists() or not list(profile_cache.glob("*.json"))
    finally:
        shutdown(llm)
    path = tmp_path / "mine.json"
    StepProfile([1, 8, 64], [0.01, 0.012, 0.03], [0.002, 0.003, 0.01], [1, 8], [0.002, 0.003],
                meta={"source": "hand-written"}).save(str(path))
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": str(path)})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "hand-written"
    finally:
        shutdown(llm)


def test_a_bad_profile_path_stops_start_up_naming_the_key(tiny_models, tmp_path):
    bad = tmp_path / "nope.json"
    with pytest.raises(Exception) as err:
        make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                 specplug={"profile": str(bad)})
    assert 'additional_config["specplug"].profile' in str(err.value)


SLOW_CALLS = 6
SLOW_S = 0.5  # what each slow call adds: 5x the fixed profile's price of a drafting step


def _fixed_profile(path):
    # A memory-bound target (100 ms a step at every size) and a cheap draft
    # (1 ms a position): a perfect draft belongs at the ceiling, by a margin
    # that no correction within its clip [0.5, 2] reverses.  Fixed, so the
    # verdict does not depend on how fast this machine runs the tiny models.
    from vllm_specplug.controller import StepProfile

    StepProfile([1, 8, 64, 512], [0.1, 0.1, 0.101, 0.11], [0.001] * 4, [1, 16], [0.001, 0.0012],
                meta={"source": "fixed"}).save(str(path))
    return str(path)


def test_slow_first_draft_calls_while_serving_do_not_keep_a_perfect_draft_off(
        tiny_models, plain, tmp_path):
    # The draft's first SLOW_CALLS proposals while serving take SLOW_S more,
    # five times what the profile says a drafting step costs, as new shapes
    # and cold caches do on a real engine.  Priced from live steps, such
    # steps make drafting look 5x dearer than decoding and nothing drafts
    # again; priced from the profile they only nudge its correction.
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": _fixed_profile(tmp_path / "fixed.json")})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "fixed"
        drafter = drafter_of(llm)
        original = drafter.propose
        calls = {"n": 0, "slowed": 0}

        def slow_propose(*args, **kwargs):
            k = kwargs.get("num_speculative_tokens", args[0] if args else 0)
            calls["n"] += 1
            result = original(*args, **kwargs)
            if k > 0 and calls["slowed"] < SLOW_CALLS:  # calls that draft
                calls["slowed"] += 1
                time.sleep(SLOW_S)
            return result

        drafter.propose = slow_propose
        outs = [llm.generate([p], greedy(LONG), use_tqdm=False)[0] for p in PROMPTS]
        assert calls["slowed"] == SLOW_CALLS, calls
        assert token_ids(outs) == plain
        for o in outs:
            steps = drafted_per_step(o)
            # A perfect draft ends at the ceiling: the last quarter of every
            # request, but for its last two steps, where fewer tokens are
            # left before max_tokens than the ceiling's drafts.
            tail = steps[-len(steps) // 4:-2]
            assert tail and all(s == CEILING for s in tail), steps
        ratios = scheduler_of(llm).specplug.controller.pricer.correction
        assert ratios.observations > 0
    finally:
        shutdown(llm)


class _RecordingBench:
    """The measurement's bench interface, recording every step; no engine.

    Like vLLM's runners it refuses a step that verifies more drafts than the
    step before proposed (new requests have proposed none)."""

    def __init__(self):
        self.steps: list[tuple[int, int, int]] = []  # (k_step, drafts, proposed before)
        self.proposed, self.n, self.now = 0, 0, 0.0

    @property
    def size(self):
        return self.n

    def add(self, n):
        if n > 0:
            self.n += n
            self.proposed = 0  # prefilled: nothing drafted for them yet

    def step(self, k_step, drafts):
        from vllm_specplug.profiling import ProfileSequenceError

        self.steps.append((k_step, drafts, self.proposed))
        if drafts > self.proposed:
            raise ProfileSequenceError(f"{drafts} after {self.proposed}")
        self.proposed = k_step
        # A memory-bound step with a draft a tenth its size.
        seconds = 0.01 + 0.001 * (k_step > 0) + 0.001 * max(k_step - 1, 0)
        self.now += seconds
        return seconds, self.n * (1 + drafts), self.n if k_step else 0


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("max_batch", [1, 5, 16])
def test_profile_sequence_never_verifies_more_drafts_than_were_proposed(k, max_batch):
    from vllm_specplug import profiling

    bench = _RecordingBench()
    prof = profiling.run_rounds(bench, k, max_batch, 4096, True, lambda: bench.now, budget_s=1e9)
    assert all(drafts <= before for _, drafts, before in bench.steps)
    # Every shape the table needs was run: verifying K drafts, and K draft positions.
    assert any(d == k for _, d, _ in bench.steps) and any(s == k for s, _, _ in bench.steps)
    assert prof.batch[-1] == max_batch
    # The cached table's check runs a sequence of its own.
    bench = _RecordingBench()
    profiling.validate_steps(bench, k)
    assert all(drafts <= before for _, drafts, before in bench.steps)
    assert (k, k, k) in bench.steps


def test_profile_sequence_check_fails_on_the_old_order():
    """The bench's refusal is what the property above rests on: the order the
    profile used to run, (1, K) right after (1, 0), is refused."""
    from vllm_specplug.profiling import ProfileSequenceError

    bench = _RecordingBench()
    bench.add(1)
    bench.step(1, 0)
    with pytest.raises(ProfileSequenceError):
        bench.step(1, CEILING)


def test_the_measurement_is_refused_with_kv_events_or_connectors():
    from types import SimpleNamespace

    from vllm_specplug.profiling import measurement_blocked

    def config(**kw):
        base = dict(kv_events_config=None, kv_transfer_config=None, ec_transfer_config=None)
        return SimpleNamespace(**{**base, **kw})

    assert measurement_blocked(config()) is None
    assert measurement_blocked(config(kv_events_config=SimpleNamespace(
        enable_kv_cache_events=False))) is None
    assert "events" in measurement_blocked(config(kv_events_config=SimpleNamespace(
        enable_kv_cache_events=True)))
    assert "KV connector" in measurement_blocked(config(kv_transfer_config=object()))
    assert "encoder-cache" in measurement_blocked(config(ec_transfer_config=object()))


def test_an_engine_with_kv_events_measures_nothing(tiny_models, profile_cache, monkeypatch):
    """vLLM publishes KV events here (on a free local port): no throwaway
    scheduler is built, so no second publisher and no dummy blocks; the
    policy prices from parameter counts."""
    from vllm_specplug import profiling

    def no_bench(*a, **k):
        raise AssertionError("a throwaway scheduler was built")

    monkeypatch.setattr(profiling.testbench, "_Bench", no_bench)
    port = free_port()
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"},
                   kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": f"tcp://127.0.0.1:{port}"})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "prior"
    finally:
        shutdown(llm)


def test_the_profile_has_a_deadline_frees_its_requests_and_shuts_its_scheduler_down(
        tiny_models, profile_cache, monkeypatch):
    """A measurement that runs out of time ends start-up's wait: the engine
    starts on prices from parameter counts, its requests and KV blocks freed
    and the throwaway scheduler shut down; then it serves exactly."""
    from vllm_specplug import profiling

    seen = {}
    original_close = profiling._Bench.close

    def close(self):
        original_close(self)
        seen["requests"] = len(self.scheduler.requests)
        seen["free"] = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        seen["total"] = self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks

    shut = []
    monkeypatch.setattr(profiling._Bench, "close", close)
    from vllm.v1.core.sched.scheduler import Scheduler

    original_shutdown = Scheduler.shutdown
    monkeypatch.setattr(Scheduler, "shutdown",
                        lambda self: (shut.append(type(self).__name__), original_shutdown(self)))
    monkeypatch.setattr(profiling.testbench, "DEADLINE_S", 0.0)
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "auto"})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "prior"
        assert seen["requests"] == 0
        assert seen["free"] >= seen["total"] - 1  # the null block
        assert "_ProfileScheduler" in shut
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [LONG] * len(PROMPTS)
    finally:
        shutdown(llm)


def test_a_later_engine_never_takes_an_earlier_engines_table(tiny_models, profile_cache,
                                                            tmp_path):
    """The profile travels with the engine's own KV cache config: a second
    engine in the same process, with no profile of its own, prices from its
    parameter counts, not from the first engine's table."""
    from vllm_specplug.controller import StepProfile

    path = tmp_path / "first.json"
    StepProfile([1, 8, 64], [0.01, 0.012, 0.03], [0.002, 0.003, 0.01], [1, 8], [0.002, 0.003],
                meta={"source": "first engine"}).save(str(path))
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": str(path)})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "first engine"
    finally:
        shutdown(llm)
    llm = make_llm(tiny_models["target"], speculative=draft_model(tiny_models["target"]),
                   specplug={"profile": "off"})
    try:
        assert scheduler_of(llm).specplug.profile.meta["source"] == "prior"
    finally:
        shutdown(llm)


def test_the_cache_key_names_runner_async_scheduling_and_compilation(tiny_models):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug import profiling

    args = EngineArgs(model=tiny_models["target"], enforce_eager=True, dtype="float32",
                      max_model_len=256, speculative_config=draft_model(tiny_models["target"]))
    vllm_config = args.create_engine_config()
    key = profiling.deployment_key(vllm_config, True)
    assert key["runner"] == "cpu-v1"
    assert key["async_scheduling"] is False
    assert "cudagraph=" in key["compilation"] and "mode=" in key["compilation"]
    vllm_config.scheduler_config.async_scheduling = True
    assert profiling.cache_path(profiling.deployment_key(vllm_config, True)) != \
        profiling.cache_path(key)
