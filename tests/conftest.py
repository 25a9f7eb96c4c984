"""Shared fixtures: tiny models made at test time, one engine per module.

Engines run in single-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="uni"``) so the scheduler object is reachable
at ``llm.llm_engine.engine_core.engine_core.scheduler``.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Step-cost profiles the tests measure (``profile: auto``) go to a temporary
# cache, not the user's.
if "VLLM_SPECPLUG_PROFILE_CACHE" not in os.environ:
    import tempfile

    os.environ["VLLM_SPECPLUG_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="specplug-profiles-")

import pytest

CEILING = 4

# Suites that need a process of their own, run by ``make test`` after the main one:
# engine_v2/ turns every engine of its process onto vLLM's V2 runner;
# side runs the scheduler-level suite on another vLLM's scheduler (vllm_side.py).
SUITE = os.environ.get("SPECPLUG_SUITE", "")
collect_ignore = [] if SUITE == "engine_v2" else ["engine_v2"]
if SUITE == "side":
    import vllm_side

    vllm_side.install()


def _fixed_profile_path() -> str:
    """A fixed step-cost profile for the engine tests' decisions.

    A memory-bound target (a step costs the same for 1 or 16 tokens) and a
    draft whose first pass costs 15% of a step and each further position
    5%: a perfect draft belongs at the ceiling, a draft accepted one time in
    ten or less at K=0, whatever this machine's speed.  With the live
    correction off (``FIXED_SPECPLUG``) an engine test's decisions depend on
    acceptance alone, so its verdict is the same on a loaded machine and a
    quiet one.  Tests of the measured profile ask for ``profile: auto``.
    """
    import tempfile

    from vllm_specplug.controller import StepProfile

    path = os.path.join(tempfile.mkdtemp(prefix="specplug-fixed-profile-"), "fixed.json")
    StepProfile([1, 16, 128, 1024], [1.0, 1.0, 1.05, 1.5], [0.15] * 4, [1, 64], [0.05, 0.06],
                meta={"source": "fixed (tests)"}).save(path)
    return path


FIXED_SPECPLUG = {"profile": _fixed_profile_path(), "profile_correction": False}


def with_fixed_profile(specplug: dict | None) -> dict:
    """``specplug`` on the fixed profile, unless it names a profile itself."""
    specplug = dict(specplug or {})
    return specplug if "profile" in specplug else {**FIXED_SPECPLUG, **specplug}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from vllm_specplug.tools.testing import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"))


def make_llm(model, speculative=None, adaptive=True, specplug=None, **kw):
    """An engine on a tiny model; ``speculative`` is a speculative_config dict."""
    from vllm import LLM

    args = dict(
        model=model,
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=512,
        max_num_seqs=16,
        seed=0,
        dtype="float32",
    )
    if speculative is not None:
        args["speculative_config"] = speculative
        args["per_request_spec_decode_metrics"] = "detailed"
        if adaptive:
            args["scheduler_cls"] = "vllm_specplug.AdaptiveSpecScheduler"
            args["additional_config"] = {"specplug": with_fixed_profile(specplug)}
    args.update(kw)
    # A second engine in this process works once numba is imported because
    # the plugin patches vLLM's kernel-override scan
    # (vllm_specplug/patches/kernel_override_scan.py).
    return LLM(**args)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    """Both of vLLM's schedulers (the scheduler-level suites)."""
    return request.param


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def model_runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def drafter_of(llm):
    return model_runner(llm).drafter


def draft_model(path, k=CEILING) -> dict:
    """A ``speculative_config`` that drafts ``k`` tokens with the model at ``path``."""
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def count_forwards(module):
    """Counts ``module``'s forward calls: (a one-item list of the count, the hook's handle)."""
    calls = [0]
    handle = module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def count_preemptions(sched) -> list:
    """The ids of the requests ``sched`` preempts from now on (a list that grows)."""
    preempted = []
    original = sched._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    sched._preempt_request = counting
    return preempted


def shutdown(llm):
    from vllm_specplug.tools.testing import shutdown_llm

    shutdown_llm(llm)


def greedy(max_tokens=48, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def plain_token_ids(model, prompts, max_tokens=48) -> list[list[int]]:
    """Plain decoding's greedy tokens for ``prompts`` (an engine started and
    shut down): what every speculative run is compared with."""
    llm = make_llm(model)
    outs = token_ids(llm.generate(prompts, greedy(max_tokens), use_tqdm=False))
    shutdown(llm)
    return outs


def drafted_per_step(output):
    m = output.outputs[0].spec_decode_metrics
    return list(m.per_step_drafted) if m is not None else []



def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skipped on CPU machines and in CI)")


def acceptance(output, skip_steps=0):
    """Accepted / drafted over a request's steps (None if nothing drafted)."""
    m = output.outputs[0].spec_decode_metrics
    drafted = sum(m.per_step_drafted[skip_steps:])
    accepted = sum(m.per_step_accepted[skip_steps:])
    return accepted / drafted if drafted else None


def run_with_forced_fallback(llm, prompts, ceiling, off_from=4, off_steps=24, max_tokens=96):
    """Drive the engine step by step; every request's ceiling is 0 from step
    ``off_from`` for ``off_steps`` steps, then ``ceiling`` again.  Returns
    the finished outputs in the order of ``prompts``."""
    engine = llm.llm_engine
    controller = scheduler_of(llm).specplug.controller
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens,
                                             extra_args={"specplug_max_k": ceiling}))
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if step == off_from or step == off_from + off_steps:
            cap = 0 if step == off_from else ceiling
            for rid in list(controller._row_of):
                controller.set_ceiling(rid, cap)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[f"r{i}"] for i in range(len(prompts))]
