"""The synthetic driver of the scheduler-level suites (``test_scheduler_level.py``,
``test_scheduler_lifecycle.py``): the plugin's scheduler on vLLM's real
``Scheduler`` or ``AsyncScheduler``, no model, a synthetic clock, every step
checked (``SyntheticRun.check``).
"""

from conftest import CEILING
from vllm_specplug.tools.testing import FakeEngine


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
