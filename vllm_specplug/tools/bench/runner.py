"""Running one benchmark: engines, interleaved policies, measurements.

Two engines per setup, one after the other (two Qwen engines do not fit
in this machine's memory together): the plain engine (no speculation) and
one speculative engine whose policy is switched between runs
(``tools/bench/reconfigure.py``), so every speculative policy shares one
engine start and the policies run interleaved, A B C A B C, per cell.  The
plain engine runs each cell before and after the speculative engine, and
its median is the baseline, so drift over the run is bracketed.

A run drives vLLM's engine directly (``LLMEngine.add_request``/``step``)
as ``concurrency`` closed-loop clients: a new request is added as soon as
one finishes, until the workload's prompts are used up.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from vllm_specplug.tools.bench.reconfigure import reconfigure
from vllm_specplug.tools.bench.setups import VLLM_TABLE, Setup, policy_overrides


@dataclass
class RunResult:
    setup: str
    workload: str
    concurrency: int
    policy: str
    rep: int
    tok_s: float
    wall_s: float
    output_tokens: int
    tpot_mean_s: float
    tpot_p90_s: float
    accepted_len: float  # tokens per verify step incl. the bonus token (1.0 = none)
    drafted_per_step: float  # drafts per request-step
    fallback_frac: float  # request-steps without drafts
    engine_steps: int
    outputs: list = field(default_factory=list, repr=False)
    k_trace: list = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d.pop("k_trace")
        return d


def env_defaults(env=None) -> None:
    """The benchmark's vLLM settings, where unset, in ``env`` (default: this process's)."""
    import os

    env = os.environ if env is None else env
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (max(os.cpu_count() or 1, 1) - 1))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")


def resolve_model(key: str, tiny_root: str | None) -> str:
    if key.startswith("tiny:"):
        from vllm_specplug.tools.testing import make_successor_models

        return make_successor_models(tiny_root)[key[len("tiny:"):]]
    from vllm_specplug.tools import models

    if not models.is_cached(key):
        raise SystemExit(f"model {key!r} is not in the cache; fetch it with:\n"
                         f"  python -m vllm_specplug.tools.models fetch {key}")
    return str(models.model_path(key))


def start_engine(setup: Setup, speculative: bool, max_num_seqs: int, tiny_root: str | None):
    from vllm import LLM

    args = dict(model=resolve_model(setup.target, tiny_root), enforce_eager=True,
                distributed_executor_backend="uni", max_num_seqs=max_num_seqs, seed=0)
    args.update(setup.engine_extra)
    if speculative:
        spec = {"method": setup.method, "num_speculative_tokens": setup.ceiling,
                **setup.spec_extra}
        if setup.draft:
            spec["model"] = resolve_model(setup.draft, tiny_root)
        args["speculative_config"] = spec
        args["scheduler_cls"] = "vllm_specplug.AdaptiveSpecScheduler"
        args["per_request_spec_decode_metrics"] = "detailed"
        args["additional_config"] = {"specplug": {"log_interval_s": 0}}
    llm = LLM(**args)
    # One short request so lazy initialisation is not timed.
    from vllm import SamplingParams

    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return llm


def stop_engine(llm) -> None:
    from vllm_specplug.tools.testing import shutdown_llm

    shutdown_llm(llm)
    gc.collect()


# Controllers kept per (policy, workload) between their runs: a policy is
# measured as on a server that has been running it, not restarted for every
# few requests (its cost model and acceptance profile carry over; requests'
# own state is empty between runs).
_CONTROLLERS: dict[tuple, object] = {}


def configure_policy(llm, setup: Setup, policy: str, trace_path: str | None = None,
                     workload: str | None = None) -> None:
    """Switch the speculative engine to ``policy`` (between runs only)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    overrides, pin, table = policy_overrides(policy)
    if trace_path:
        overrides["trace_path"] = trace_path
    else:
        overrides["trace_path"] = None
    sched.dynamic_sd_lookup = (build_dynamic_sd_schedule_lookup(
        VLLM_TABLE, vllm_max_batch_size=sched.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=sched.num_spec_tokens) if table else None)
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache between runs")
    if setup.method == "draft_model":
        from vllm_specplug.tools.bench.reconfigure import set_zero_cost

        drafter = core.model_executor.driver_worker.worker.model_runner.drafter
        on = set_zero_cost(drafter, bool(overrides.get("zero_cost_fallback")))
        # Before the controller is rebuilt: whether the draft runs at
        # K_step=0 shapes its cost model.
        overrides["zero_cost_fallback"] = on
    sp = sched.specplug
    if workload is not None and sp.enabled:
        # Park the controller of the policy that just ran.
        last = getattr(sp, "bench_key", None)
        if last is not None:
            _CONTROLLERS[last] = sp.controller
    reconfigure(sp, overrides, pin_k_step=pin)
    key = (id(llm), policy, workload) if workload is not None else None
    sp.bench_key = key
    if key in _CONTROLLERS:
        sp.controller = _CONTROLLERS[key]
        if sp.metrics is not None:
            sp.metrics.controller_replaced(sp.controller)


def run_cell(llm, prompts, concurrency: int, speculative: bool) -> dict:
    """Closed-loop clients over ``prompts``; returns raw measurements."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    queue = list(enumerate(prompts))
    inflight: dict[str, int] = {}
    first_token: dict[str, float] = {}
    finished: dict[int, object] = {}
    finish_time: dict[str, float] = {}
    steps = 0
    counter = [0]
    # Steps in which each request produced tokens (its decode steps, plus
    # the prefill step that produced its first token).
    produced: dict[str, int] = {}
    request_steps_of: dict[str, int] = {}

    def add_one() -> None:
        i, (text, max_tokens) = queue.pop(0)
        counter[0] += 1
        rid = f"bench-{i}-{counter[0]}"
        engine.add_request(rid, text, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        inflight[rid] = i

    t0 = time.perf_counter()
    while queue and len(inflight) < concurrency:
        add_one()
    while inflight:
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in inflight:
                continue
            n_now = len(o.outputs[0].token_ids) if o.outputs else 0
            if n_now > produced.get(o.request_id, 0):
                produced[o.request_id] = n_now
                request_steps_of[o.request_id] = request_steps_of.get(o.request_id, 0) + 1
            if o.request_id not in first_token and n_now:
                first_token[o.request_id] = now
            if o.finished:
                finished[inflight.pop(o.request_id)] = o
                finish_time[o.request_id] = now
                if queue:
                    add_one()
    wall = time.perf_counter() - t0
    outputs = [finished[i] for i in range(len(prompts))]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = []
    drafted = accepted = verify_steps = request_steps = 0
    for o in outputs:
        n = len(o.outputs[0].token_ids)
        if n > 1 and o.request_id in first_token:
            tpots.append((finish_time[o.request_id] - first_token[o.request_id]) / (n - 1))
        m = getattr(o.outputs[0], "spec_decode_metrics", None) if speculative else None
        acc = d = vs = 0
        if m is not None:
            d = m.num_draft_tokens
            acc = sum(m.per_step_accepted)
            vs = sum(1 for x in m.per_step_drafted if x > 0)
        drafted += d
        accepted += acc
        verify_steps += vs
        # Decode steps: every step that produced tokens, less the prefill step.
        request_steps += max(request_steps_of.get(o.request_id, 1) - 1, 1)
    tpots.sort()
    return dict(
        wall_s=wall,
        output_tokens=tokens,
        tok_s=tokens / wall if wall > 0 else 0.0,
        tpot_mean_s=statistics.fmean(tpots) if tpots else float("nan"),
        tpot_p90_s=tpots[min(len(tpots) - 1, int(0.9 * len(tpots)))] if tpots else float("nan"),
        accepted_len=1.0 + accepted / verify_steps if verify_steps else 1.0,
        drafted_per_step=drafted / request_steps if request_steps else 0.0,
        fallback_frac=max(0.0, 1.0 - verify_steps / request_steps) if request_steps else 1.0,
        engine_steps=steps,
        outputs=[list(o.outputs[0].token_ids) for o in outputs],
    )


class Progress:
    """A one-line progress bar with the time left, on stderr."""

    def __init__(self, total_units: float, label: str) -> None:
        self.total = max(total_units, 1e-9)
        self.done = 0.0
        self.t0 = time.time()
        self.label = label

    def advance(self, units: float, note: str) -> None:
        self.done += units
        frac = min(self.done / self.total, 1.0)
        elapsed = time.time() - self.t0
        left = elapsed / frac - elapsed if frac > 0 else float("nan")
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        print(f"[bench] [{bar}] {100 * frac:5.1f}%  {elapsed / 60:5.1f} min elapsed, "
              f"~{left / 60:4.1f} min left  | {note}", file=sys.stderr, flush=True)
