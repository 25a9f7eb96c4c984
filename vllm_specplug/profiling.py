"""Measure the step-cost profile on the engine itself, before it serves.

The policy prices every plan from a ``StepProfile`` (controller/profile.py).
This module measures one in the engine-core process, after vLLM has loaded
the models, allocated the KV cache and warmed up, and before the scheduler
exists (``patches/startup_profile.py`` calls ``profile_for_engine``).  It
runs the engine's own steps: a throwaway instance of vLLM's ``Scheduler``
over the real KV cache config schedules dummy requests (random prompt
tokens, greedy, no EOS), and each step goes through the executor exactly as
``EngineCore.step`` sends it (``execute_model``, ``sample_tokens``,
``take_draft_token_ids``), so attention runs over real contexts, KV is
written, the drafter runs vLLM's own code, and under tensor parallelism
every rank runs the step while the engine core times it: one table, rank
0's view, for every rank.  Steps are timed exactly as the adapter times
live steps (from the end of ``schedule()`` to the model output).

Per batch size B (1, 2, 4, ... up to ``max_num_seqs``, within a time
budget) and the ceiling K, rounds of six steps (K_step, drafts verified):

    (0, K)   target(B (1 + K))
    (0, 0)   target(B)
    (1, 0)   target(B) + first(B), and the catch-up of the two plain steps
    (1, 0)   target(B) + first(B)
    (K, 0)   target(B) + first(B) + (K - 1) pass(B)
    (K, K)   target(B (1 + K)) + first(B (1 + K)) + (K - 1) pass(B)

so that no step verifies more drafts than the step before it proposed
(the last step of a round proposes K for the first of the next; a lead-in
step at K_step = K precedes a round wherever that is not so).  vLLM's GPU
runners gather a step's drafts from what the previous step proposed: more
would read past them (``test_profile_sequence_*`` checks every sequence
this module runs).  The rounds are timed ``ROUNDS`` or more times after
one discarded warm-up round.  Interference on a shared host
(another process on the cores, a page fault, a GC pause) comes and goes
over seconds: timed in rounds it lands on every shape alike instead of on
whichever shape happened to be measured then, and the first-pass and
draft-pass costs are differences of steps of the same round.  Each price
is the median over rounds.  The draft-pass and catch-up curves are then
made non-decreasing in their size (an isotonic fit, ``StepProfile.monotone``):
where the medians say a pass over more requests costs less, the fit averages
the two.  The token curves stay as measured (their points come from
different batch sizes, and a smaller shape can be truly slower); each plan
reads them non-decreasing from its own step's size up
(``GoodputPolicy.prices``), so no dip is left for the argmax to chase.  The
raw medians stay in ``meta["raw"]``.

The steps run on a throwaway scheduler of the engine's own kind (vLLM's
``AsyncScheduler`` when the engine schedules asynchronously, so drafts and
rejected tokens are accounted as the workers expect), within a deadline
(``DEADLINE_S``: a KV cache too small for the dummy requests cannot make
start-up hang), and it is shut down afterwards.  It is never built where
KV events or a KV / encoder-cache connector are configured (a second
publisher and connectors would see the dummy requests): there the policy
prices steps from parameter counts.

The drafts verified are placeholders put in each request's
``spec_token_ids`` (almost always rejected: verification costs the same;
under async scheduling the worker's own drafts).
With the zero-cost fallback the first K_step = 1 step of each round
follows two K_step = 0 steps and so also catches the draft up: the worker
repairs whole KV blocks, from the start of the first block the skipped
steps left stale to each request's computed length.  Timed against the
round's K_step = 1 step, that is the catch-up curve, indexed by those
tokens (``deployment.catch_up_tokens``, which the scheduler counts alike).
Afterwards the requests are finished (the workers drop them) and the
zero-cost fallback's stale-block marks are reset, since no block the
profile wrote can be read again.

The profile reaches the scheduler on the KV cache config the engine core
builds it from (``attach`` / ``attached``): one engine, one table.

A measured table is cached (``cache_dir()``/<key>.json), keyed by
everything that changes step time (``deployment_key``).  Before a cached
table is trusted two fresh shapes are timed against it; if either is more
than ``VALIDATE_TOLERANCE`` off, the table is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform as _platform
import statistics
import time
from typing import Any

from vllm_specplug.controller.profile import StepProfile
from vllm_specplug.deployment import catch_up_tokens, model_runner

logger = logging.getLogger("vllm.specplug")

# Rounds per batch size (one step of each shape a round): at least ROUNDS,
# more (up to MAX_ROUNDS) while a batch size's rounds take under ROUNDS_S,
# so that millisecond steps get a robust median.
ROUNDS = 4
MAX_ROUNDS = 9
ROUNDS_S = 1.5
# Untimed rounds at batch 1 before any is timed (the process's first steps),
# and discarded rounds at each batch size (its shapes' first steps).
LEAD_ROUNDS = 2
SIZE_WARMUP_ROUNDS = 1
# Timed repeats of one shape where a shape is timed on its own (validate).
REPEATS = 3
WARMUP = 1
PROMPT_TOKENS = 32
# Seconds the measurement may take before it stops adding larger batches.
BUDGET_S = 75.0
VALIDATE_TOLERANCE = 0.25
# Part of the cache key: a table measured by an older procedure is measured again.
PROFILE_FORMAT = 5
_REQ_PREFIX = "specplug-profile-"

# Seconds after which the measurement gives up (the policy then prices
# from parameter counts): a step never ends the measurement on its own.
DEADLINE_S = 4 * BUDGET_S
# The attribute of the scheduler's KV cache config that carries the profile
# from the engine core's KV-cache set-up to the scheduler built from it.
PROFILE_ATTR = "specplug_step_profile"
DEPLOYMENT_ATTR = "specplug_deployment"


class ProfileSequenceError(RuntimeError):
    """A step would verify more drafts than the step before it proposed."""


def attach(kv_cache_config, profile: StepProfile | None, deployment=None) -> None:
    """Hand ``profile``, and the ``Deployment`` settled for it, to the scheduler
    that will be built from ``kv_cache_config``."""
    setattr(kv_cache_config, PROFILE_ATTR, profile)
    if deployment is not None:
        setattr(kv_cache_config, DEPLOYMENT_ATTR, deployment)


def attached(kv_cache_config) -> StepProfile | None:
    """The profile measured for the engine whose scheduler has this KV cache config."""
    return getattr(kv_cache_config, PROFILE_ATTR, None)


def attached_deployment(kv_cache_config):
    """The ``deployment.Deployment`` the start-up profile settled for this engine, or None."""
    return getattr(kv_cache_config, DEPLOYMENT_ATTR, None)


def measurement_blocked(vllm_config) -> str | None:
    """Why a throwaway scheduler must not run dummy requests on this engine, or None."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is not None and getattr(events, "enable_kv_cache_events", False):
        return "KV cache events are published (a KV-aware router would index dummy blocks)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector is configured (it would see the dummy requests)"
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        return "an encoder-cache connector is configured"
    return None


def cache_dir() -> str:
    """``$VLLM_SPECPLUG_PROFILE_CACHE``, or ``~/.cache/vllm-specplug/profiles``."""
    return os.environ.get("VLLM_SPECPLUG_PROFILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-specplug", "profiles")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def deployment_key(vllm_config, zero_cost: bool) -> dict[str, Any]:
    """Everything that changes how long a step takes."""
    import torch
    import vllm

    from vllm_specplug.version import __version__

    mc, spec = vllm_config.model_config, vllm_config.speculative_config
    par, cache = vllm_config.parallel_config, vllm_config.cache_config
    sched = vllm_config.scheduler_config
    draft = getattr(spec, "draft_model_config", None)
    try:
        from vllm.platforms import current_platform

        device = (cpu_model() if current_platform.is_cpu()
                  else str(current_platform.get_device_name()))
    except Exception:
        device = cpu_model()
    return {
        "target": str(mc.model), "draft": str(getattr(draft, "model", None)),
        "method": str(getattr(spec, "method", None)),
        "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0),
        "dtype": str(mc.dtype), "kv_cache_dtype": str(cache.cache_dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "tensor_parallel_size": int(par.tensor_parallel_size),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(mc.max_model_len), "block_size": int(cache.block_size),
        "enforce_eager": bool(mc.enforce_eager),
        "runner": model_runner(vllm_config),
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
        "compilation": _compilation(vllm_config),
        "zero_cost_fallback": bool(zero_cost),
        "threads": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")},
        "torch_threads": int(torch.get_num_threads()),
        "device": device, "cpus": os.cpu_count(),
        "torch": torch.__version__, "vllm": vllm.__version__, "plugin": __version__,
        "format": PROFILE_FORMAT,
    }


def _compilation(vllm_config) -> str:
    """Compilation mode and CUDA-graph mode, as vLLM resolved them."""
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "mode", None)
    graphs = getattr(comp, "cudagraph_mode", None)
    return f"mode={getattr(mode, 'name', mode)} cudagraph={getattr(graphs, 'name', graphs)}"


def cache_path(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{digest}.json")


class _Bench:
    """Dummy requests on a throwaway vLLM scheduler, stepped through the executor.

    ``step`` refuses a step that verifies more drafts than the previous one
    proposed (``proposed``: the previous step's K_step, 0 after requests are
    added), and any step past ``deadline`` (``clock()`` seconds)."""

    def __init__(self, executor, vllm_config, kv_cache_config, deadline: float,
                 clock=time.monotonic) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        k_step_box = self.k_step = [0]
        self.is_async = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))

        class _ProfileScheduler(AsyncScheduler if self.is_async else Scheduler):
            def _update_after_schedule(self, scheduler_output) -> None:
                # Before vLLM's update: the async scheduler sizes the next
                # step's draft placeholders from it.
                scheduler_output.num_spec_tokens_to_schedule = k_step_box[0]
                super()._update_after_schedule(scheduler_output)

        block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.scheduler = _ProfileScheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block, hash_block_size=hash_block, log_stats=False)
        self.executor = executor
        self.deadline = deadline
        self.clock = clock
        self.proposed = 0
        # Full blocks are hashed for the prefix cache as the engine core
        # does it (the throwaway scheduler's cache is dropped with it).
        self.hasher = None
        if vllm_config.cache_config.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            from vllm_specplug.compat import block_hasher_args

            fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(fn)
            self.hasher = get_request_block_hasher(hash_block or block, fn,
                                                   *block_hasher_args(vllm_config))
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.ids: list[str] = []
        # Zero-cost fallback: per request, the first position its draft
        # skipped, to count a catch-up as the scheduler does.
        self.stale_from: dict[str, int] = {}
        self.block_size = int(vllm_config.cache_config.block_size)
        import random

        self.rng = random.Random(0)

    @property
    def size(self) -> int:
        return len(self.ids)

    def add(self, n: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        for _ in range(n):
            rid = f"{_REQ_PREFIX}{len(self.ids)}"
            prompt = [self.rng.randrange(10, max(self.vocab - 10, 11))
                      for _ in range(PROMPT_TOKENS)]
            params = SamplingParams(temperature=0.0, max_tokens=self.max_len, ignore_eos=True)
            self.scheduler.add_request(Request(rid, prompt, params, None,
                                               block_hasher=self.hasher))
            self.ids.append(rid)
        # Prefill them (untimed) before any shape is measured.
        while any(self.scheduler.requests[r].num_computed_tokens
                  < self.scheduler.requests[r].num_prompt_tokens for r in self.ids):
            self.step(0, 0)

    def step(self, k_step: int, drafts: int) -> tuple[float, int, int]:
        """One engine step; returns (seconds, tokens scheduled, catch-up tokens)."""
        if drafts > self.proposed:
            raise ProfileSequenceError(
                f"a step verifying {drafts} drafts after one that proposed {self.proposed}")
        if self.clock() > self.deadline:
            raise TimeoutError(f"the step-cost profile ran past its {DEADLINE_S:.0f} s deadline")
        sched = self.scheduler
        for rid in self.ids:
            req = sched.requests[rid]
            if req.num_computed_tokens >= req.num_prompt_tokens:
                # Async: the placeholders the previous step left, which the
                # workers fill with their own drafts; sync: stand-ins.
                req.spec_token_ids = (list(req.spec_token_ids[:drafts]) if self.is_async
                                      else [req.all_token_ids[-1]] * drafts)
        catchup = 0
        if k_step == 0:
            for rid in self.ids:
                self.stale_from.setdefault(rid, sched.requests[rid].num_computed_tokens)
        elif self.stale_from:
            catchup = sum(catch_up_tokens(start, sched.requests[rid].num_computed_tokens,
                                          self.block_size)
                          for rid, start in self.stale_from.items())
            self.stale_from = {}
        self.k_step[0] = k_step
        out = sched.schedule()
        start = time.perf_counter()
        result = self.executor.execute_model(out)
        if result is None:
            result = self.executor.sample_tokens(None)
        seconds = time.perf_counter() - start
        sched.update_from_output(out, result)
        if not self.is_async:  # as EngineCore: async drafts stay with the workers
            self.executor.take_draft_token_ids()
        # Requests still prefilling propose nothing; the bench's steps keep
        # every request past its prompt before a shape is timed.
        self.proposed = k_step if all(
            sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens
            for r in self.ids) else 0
        return seconds, out.total_num_scheduled_tokens, catchup

    def close(self) -> None:
        from vllm.v1.request import RequestStatus

        try:
            if self.ids:
                self.scheduler.finish_requests(self.ids, RequestStatus.FINISHED_ABORTED)
                # One empty step tells the workers to drop the requests.
                out = self.scheduler.schedule()
                self.executor.execute_model(out)
            self.ids = []
        finally:
            self.scheduler.shutdown()


def robust_median(times: list[float]) -> float:
    """The median of the samples within 1.5x of the fastest.

    Interference (another process on the cores, a page fault, a GC pause)
    only ever makes a step slower, and on a busy machine it hits a large
    share of millisecond steps: those samples are left out."""
    fastest = min(times)
    return statistics.median([t for t in times if t <= 1.5 * fastest])


def lead_in(bench, k: int) -> None:
    """A step at K_step = ``k`` where the previous step proposed fewer drafts."""
    if bench.proposed < k:
        bench.step(k, 0)


def _round(bench, k: int) -> dict[str, float]:
    """One step of each shape at the bench's batch: seconds, and the sizes they ran.

    Each step verifies at most what the one before it proposed; the round
    ends having proposed ``k``, ready for the next."""
    lead_in(bench, k)
    a_wide, t_wide, _ = bench.step(0, k)
    a_plain, t_plain, _ = bench.step(0, 0)
    # The first drafting step after those catches the draft up.
    c_secs, _, c_tokens = bench.step(1, 0)
    f_plain, _, _ = bench.step(1, 0)
    e_plain = bench.step(k, 0)[0] if k > 1 else f_plain
    e_wide, _, _ = bench.step(k, k)
    return {"a_wide": a_wide, "a_plain": a_plain, "catchup": max(c_secs - f_plain, 0.0),
            "first_plain": f_plain - a_plain,
            # (K, K) less (0, K) is first(B (1 + K)) + (K - 1) pass(B).
            "first_wide": (e_wide - a_wide) - (e_plain - f_plain),
            "pass": (e_plain - f_plain) / max(k - 1, 1),
            "t_wide": t_wide, "t_plain": t_plain, "c_tokens": c_tokens}


def run_rounds(bench, k: int, max_batch: int, token_budget: int, zero_cost: bool, clock,
               budget_s: float = BUDGET_S, log: bool = False) -> StepProfile:
    """The measurement on ``bench`` (``add(n)``, ``step(k_step, drafts)``, ``size``).

    ``clock()`` reads seconds (the simulator's bench keeps its own).  Returns
    the fitted profile; ``meta`` has the raw medians, the shapes timed, the
    median spread of a round's plain step around its median, and the seconds.
    """
    started = clock()
    # The process's first steps are slow beyond any one round's warm-up
    # (allocator, kernels picked on first use): a few untimed steps of each
    # kind first.
    bench.add(1)
    for _ in range(LEAD_ROUNDS):
        _round(bench, k)
    target: dict[int, list[float]] = {}
    first: dict[int, list[float]] = {}
    passes: dict[int, float] = {}
    catchups: dict[int, float] = {}
    spreads: list[float] = []
    shapes = 0
    med = statistics.median
    b = 1
    while b <= max_batch and b * (1 + k) <= token_budget:
        before = clock()
        bench.add(b - bench.size)
        for _ in range(SIZE_WARMUP_ROUNDS):  # this batch size's shapes run for the first time
            _round(bench, k)
        rounds: list[dict[str, float]] = []
        while len(rounds) < ROUNDS or (len(rounds) < MAX_ROUNDS and clock() - before < ROUNDS_S):
            rounds.append(_round(bench, k))
        shapes += 6
        col = {key: [r[key] for r in rounds] for key in rounds[0]}
        a_plain, a_wide = med(col["a_plain"]), med(col["a_wide"])
        t_plain, t_wide = int(col["t_plain"][0]), int(col["t_wide"][0])
        target.setdefault(t_plain, []).append(a_plain)
        target.setdefault(t_wide, []).append(a_wide)
        first.setdefault(t_plain, []).append(max(med(col["first_plain"]), 0.0))
        first.setdefault(t_wide, []).append(max(med(col["first_wide"]), 0.0))
        passes[b] = max(med(col["pass"]), 0.0)
        if zero_cost and col["c_tokens"][0]:
            catchups[int(med(col["c_tokens"]))] = med(col["catchup"])
        spreads.append(med(abs(x - a_plain) for x in col["a_plain"]) / a_plain)
        if log:
            logger.info("vllm-specplug: profiling B=%d: step %.1f ms plain, %.1f ms with %d "
                        "drafts each, drafting adds %.1f ms (%d rounds, %.0f s so far)", b,
                        a_plain * 1e3, a_wide * 1e3, k, med(col["first_wide"]) * 1e3,
                        len(rounds), clock() - started)
        # The next batch size takes about twice as long as this one did.
        if clock() - started + 2.0 * (clock() - before) > budget_s:
            break
        b = b * 2 if b * 2 <= max_batch or b == max_batch else max_batch
    tokens = sorted(target)
    raw = StepProfile(
        tokens, [med(target[t]) for t in tokens], [med(first[t]) for t in tokens],
        sorted(passes), [passes[x] for x in sorted(passes)],
        catchup_tokens=sorted(catchups) or None,
        catchup_s=[catchups[c] for c in sorted(catchups)] or None)
    profile = raw.monotone()
    profile.meta = {"zero_cost_fallback": bool(zero_cost), "seconds": round(clock() - started, 3),
                    "shapes": shapes, "rounds_min": ROUNDS,
                    "fit": "isotonic (draft pass, catch-up)",
                    "spread": round(med(spreads), 4) if spreads else None,
                    "raw": {key: val for key, val in raw.to_dict().items() if key != "meta"}}
    return profile


def measure(executor, vllm_config, kv_cache_config, k: int, zero_cost: bool,
            budget_s: float = BUDGET_S, reset_workers=None) -> StepProfile:
    bench = _Bench(executor, vllm_config, kv_cache_config, time.monotonic() + DEADLINE_S)
    try:
        profile = run_rounds(bench, k, max(1, int(vllm_config.scheduler_config.max_num_seqs)),
                             int(vllm_config.scheduler_config.max_num_batched_tokens), zero_cost,
                             time.monotonic, budget_s, log=True)
    finally:
        bench.close()
        if zero_cost and reset_workers is not None:
            reset_workers()
    profile.meta.update(source="measured", seconds=round(profile.meta["seconds"], 1),
                        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return profile


def shape(bench, k_step: int, drafts: int) -> tuple[float, int]:
    """Median seconds and tokens of one shape, after WARMUP discarded steps."""
    times, tokens = [], 0
    for _ in range(WARMUP):
        bench.step(k_step, drafts)
    while len(times) < REPEATS:
        seconds, tokens, _ = bench.step(k_step, drafts)
        times.append(seconds)
    return robust_median(times), tokens


def validate_steps(bench, k: int) -> tuple[float, int, float, int]:
    """Two fresh shapes on ``bench``: one request plain, and drafting K."""
    bench.add(1)
    plain, t_plain = shape(bench, 0, 0)
    lead_in(bench, k)  # proposes K (and catches the draft up)
    wide, t_wide = shape(bench, k, k)
    return plain, t_plain, wide, t_wide


def validate(executor, vllm_config, kv_cache_config, profile: StepProfile, k: int,
             zero_cost: bool = False, reset_workers=None) -> tuple[bool, str, tuple]:
    """Time two fresh shapes (one request: plain, and drafting K) against a cached table:
    whether it is kept, why, and the two ratios measured / cached."""
    bench = _Bench(executor, vllm_config, kv_cache_config, time.monotonic() + DEADLINE_S)
    try:
        plain, t_plain, wide, t_wide = validate_steps(bench, k)
    finally:
        bench.close()
        if zero_cost and reset_workers is not None:
            reset_workers()
    want_plain = profile.step(t_plain, 1, 0)
    want_wide = profile.step(t_wide, 1, k)
    ratios = (plain / want_plain, wide / want_wide)
    ok = all(1 - VALIDATE_TOLERANCE <= r <= 1 + VALIDATE_TOLERANCE for r in ratios)
    return ok, f"measured/cached {ratios[0]:.2f} (plain), {ratios[1]:.2f} (K={k})", ratios


def profile_for_engine(executor, vllm_config, kv_cache_config,
                       reset_workers=None) -> StepProfile | None:
    """The profile this engine's scheduler will use, per ``additional_config["specplug"].profile``.

    ``reset_workers()``, when given, runs after dummy steps under the
    zero-cost fallback: the workers forget the draft's stale-block marks
    (no block the dummy requests wrote can be read again).

    The profile is also attached to ``kv_cache_config`` (``attach``), which
    the engine core builds the scheduler from.  Returns None (the scheduler
    then prices from parameter counts) where nothing is measured:
    ``profile: off``, a policy that prices nothing, a method whose K_step is
    pinned, or an engine with KV events or connectors
    (``measurement_blocked``).  A path that cannot be read stops start-up
    with a message naming the key.
    """
    from vllm_specplug.config import SpecPlugConfigError
    from vllm_specplug.deployment import Deployment, uses_plugin_scheduler

    spec = vllm_config.speculative_config
    if spec is None or not uses_plugin_scheduler(vllm_config):
        return None
    dep = Deployment.settle(vllm_config)
    k, config = dep.num_spec_tokens, dep.config
    attach(kv_cache_config, None, dep)
    if k <= 0 or config.policy != "goodput" or config.profile == "off":
        return None
    if config.profile != "auto":
        try:
            profile = StepProfile.load(config.profile)
        except (OSError, ValueError, KeyError) as exc:
            raise SpecPlugConfigError(
                f'additional_config["specplug"].profile = {config.profile!r} cannot be read '
                f'as a step-cost profile ({exc}); allowed: "auto" | "off" | a path to a '
                f"profile JSON (vllm-specplug profile --config FILE writes one)") from exc
        logger.info("vllm-specplug: step-cost profile from %s", config.profile)
        attach(kv_cache_config, profile)
        return profile
    if dep.k_step_pinned:
        logger.info("vllm-specplug: K_step is pinned for this deployment (%s); no step-cost "
                    "profile is measured (prices from parameter counts and the live "
                    "correction)", dep.pin_reason)
        return None
    if dep.inert:
        return None  # the scheduler stays inert and says why
    blocked = measurement_blocked(vllm_config)
    if blocked:
        logger.info("vllm-specplug: no step-cost profile is measured: %s; prices from "
                    "parameter counts", blocked)
        return None
    zero_cost = dep.zero_cost
    key = deployment_key(vllm_config, zero_cost)
    path = cache_path(key)
    profile = None
    if os.path.exists(path) and not os.environ.get("VLLM_SPECPLUG_PROFILE_FRESH"):
        try:
            cached = StepProfile.load(path)
            ok, why, ratios = validate(executor, vllm_config, kv_cache_config, cached, k,
                                       zero_cost, reset_workers)
            if ok:
                profile = cached
                # What this start timed: the live correction starts from it.
                profile.meta["start_check"] = {"plain_batches": [1], "repeats": REPEATS,
                                               "plain": ratios[0], "drafting": ratios[1]}
                logger.info("vllm-specplug: step-cost profile from the cache (%s; %s)", path, why)
            else:
                logger.info("vllm-specplug: cached step-cost profile disagrees with this "
                            "machine (%s); measuring again", why)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("vllm-specplug: cached profile %s unreadable (%s); measuring", path, exc)
    if profile is None:
        profile = measure(executor, vllm_config, kv_cache_config, k, zero_cost,
                          reset_workers=reset_workers)
        profile.meta["key"] = key
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            profile.save(tmp)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("vllm-specplug: could not cache the profile at %s: %s", path, exc)
        # Timed now, every batch size's plain step (not kept in the cache).
        profile.meta["start_check"] = {"plain_batches": [int(b) for b in profile.batch],
                                       "repeats": ROUNDS, "plain": 1.0, "drafting": 1.0}
        logger.info("vllm-specplug: step-cost profile measured in %.1f s over %d shapes "
                    "(batch 1-%d, %d token sizes); cached at %s", profile.meta["seconds"],
                    profile.meta["shapes"], int(profile.batch[-1]), profile.tokens.size, path)
    attach(kv_cache_config, profile)
    return profile
