"""The test bench: dummy requests on a throwaway vLLM scheduler, stepped through the executor.

It runs the engine's own steps: a throwaway instance of vLLM's ``Scheduler``
over the real KV cache config schedules dummy requests (random prompt
tokens, greedy, no EOS), and each step goes through the executor exactly as
``EngineCore.step`` sends it (``execute_model``, ``sample_tokens``,
``take_draft_token_ids``), so attention runs over real contexts, KV is
written, the drafter runs vLLM's own code, and under tensor parallelism
every rank runs the step while the engine core times it: one table, rank
0's view, for every rank.  Steps are timed exactly as the adapter times
live steps (from the end of ``schedule()`` to the model output).

The steps run on a throwaway scheduler of the engine's own kind (vLLM's
``AsyncScheduler`` when the engine schedules asynchronously, so drafts and
rejected tokens are accounted as the workers expect), within a deadline
(``DEADLINE_S``: a KV cache too small for the dummy requests cannot make
start-up hang), and it is shut down afterwards.

The drafts verified are placeholders put in each request's
``spec_token_ids`` (almost always rejected: verification costs the same;
under async scheduling the worker's own drafts).  With the zero-cost
fallback a step after K_step = 0 steps also catches the draft up; the
bench counts those tokens as the scheduler does
(``deployment.catch_up_tokens``).  Afterwards the requests are finished
(the workers drop them).
"""

from __future__ import annotations

import time

from vllm_specplug.deployment import catch_up_tokens
from vllm_specplug.profiling.rounds import BUDGET_S

# Prompt tokens of the measurement's dummy requests.
# Source: constants_sweep.py at d7f86db: 8 and 128 within the noise.
PROMPT_TOKENS = 32
_REQ_PREFIX = "specplug-profile-"
# Seconds after which the measurement gives up (the policy then prices
# from parameter counts): a step never ends the measurement on its own.
# Not tuned: a safety stop (the longest measurement seen: 51 s).
DEADLINE_S = 4 * BUDGET_S


class ProfileSequenceError(RuntimeError):
    """A step would verify more drafts than the step before it proposed."""


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
