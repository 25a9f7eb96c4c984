"""The controller: estimator + step-cost profile + policy + re-probing, composed.

This is the one object the vLLM adapter talks to.  It knows request ids,
draft counts and seconds; it knows nothing about vLLM.

Prices come from the step-cost profile measured before serving; live step
times only feed the profile's clipped correction (``ProfileCorrection``).
What is learnt online is acceptance.  Exploration concerns acceptance: a
request in fallback is re-probed with a small draft on a doubling back-off,
and only when the profile says good drafts would pay; and the one price the
correction cannot learn by itself, a plain step at a batch size where the
plan always drafts, which a short run of plain steps measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numba
import numpy as np

from vllm_specplug.controller.baselines import HeuristicPolicy, StaticPolicy
from vllm_specplug.controller.confidence import ConfidenceCalibration, StopRule
from vllm_specplug.controller.correction import ProfileCorrection, band
from vllm_specplug.controller.estimator import (FORGETTING, INITIAL_ACCEPTANCE, PRIOR_STRENGTH,
                                                AcceptanceEstimator)
from vllm_specplug.controller.policy import GoodputPolicy
from vllm_specplug.controller.pricing import Decision, StepPricer
from vllm_specplug.controller.profile import UNKNOWN_DRAFT_RATIO, StepProfile, prior_profile


@numba.njit(cache=True)
def _probe_failed(r, probe_k, max_interval, backoff, probe_at, probe_size, probe_ok):
    """Request row ``r``'s probe failed (a rejection, or no verdict in time): the
    back-off doubles (up to ``max_interval``), the next probe is ``probe_k`` deep."""
    probe_at[r], probe_ok[r], probe_size[r] = -1, 0, probe_k
    backoff[r] = min(backoff[r] * 2, max_interval)


@numba.njit(cache=True)
def _probe_due(rows, k, ceilings, now, timeout, interval, probe_k, max_interval,
               in_fallback, backoff, waited, probe_at, probe_size, probe_ok, due):
    """A plan's probe bookkeeping (``SpecController._probe``), request by request.

    A request granted drafts again leaves fallback (its probe state reset);
    one granted none while its ceiling allows drafts is in fallback: a probe
    of it pending for ``timeout`` plans fails, and one not probing waits a
    plan more and is due after its back-off (at once after an accepted
    probe).  Marks the due requests in ``due`` (by batch index); returns how
    many, and how many requests came back after an accepted probe.
    """
    recoveries = 0
    fallback = False
    for i in range(rows.size):
        r = rows[i]
        if k[i] > 0 and in_fallback[r] != 0:
            if probe_ok[r] != 0:
                recoveries += 1
            backoff[r], waited[r], probe_at[r], probe_size[r] = interval, 0, -1, probe_k
            probe_ok[r] = 0
        in_fallback[r] = 1 if k[i] == 0 and ceilings[i] > 0 else 0
        fallback |= in_fallback[r] != 0
    if not fallback:
        return 0, recoveries
    n = 0
    for i in range(rows.size):
        r = rows[i]
        probing = probe_at[r] >= 0
        if probing and now - probe_at[r] >= timeout:  # no verdict came
            _probe_failed(r, probe_k, max_interval, backoff, probe_at, probe_size, probe_ok)
            probing = False
        if in_fallback[r] != 0 and not probing:
            waited[r] += 1
            if waited[r] >= backoff[r] or probe_ok[r] != 0:
                due[i] = True
                n += 1
    return n, recoveries


@numba.njit(cache=True)
def _verified(rows, drafted, accepted):
    """The verifications of requests that drafted, acceptance clipped to [0, drafted]:
    rows, drafted, accepted, and their totals."""
    n = 0
    for i in range(rows.size):
        n += drafted[i] > 0
    out_rows, out_d, out_a = (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64),
                              np.empty(n, dtype=np.int64))
    j = total_d = total_a = 0
    for i in range(rows.size):
        if drafted[i] > 0:
            out_rows[j], out_d[j] = rows[i], drafted[i]
            out_a[j] = min(max(accepted[i], 0), drafted[i])
            total_d += out_d[j]
            total_a += out_a[j]
            j += 1
    return out_rows, out_d, out_a, total_d, total_a


@numba.njit(cache=True)
def _probe_verdicts(rows, drafted, accepted, probe_k, max_interval, ceiling,
                    backoff, probe_at, probe_size, probe_ok):
    """Probes among one step's verifications: a probe fully accepted doubles the
    next probe's size (up to the ceiling), one with a rejection doubles the
    back-off (up to ``max_interval``).  Returns the probes accepted."""
    succeeded = 0
    for i in range(rows.size):
        r = rows[i]
        if probe_at[r] < 0:
            continue
        probe_at[r] = -1
        if accepted[i] >= drafted[i]:
            succeeded += 1
            probe_ok[r] = 1
            probe_size[r] = min(probe_size[r] * 2, max(ceiling[r], 1))
        else:
            _probe_failed(r, probe_k, max_interval, backoff, probe_at, probe_size, probe_ok)
    return succeeded


@numba.njit(cache=True)
def _count_plan(k, ceilings, k_counts):
    """A plan in the statistics: per-K counts; returns the slots and the requests in fallback."""
    slots = fallback = 0
    for i in range(k.size):
        if k[i] < k_counts.size:
            k_counts[k[i]] += 1
        slots += k[i]
        if k[i] == 0 and ceilings[i] > 0:
            fallback += 1
    return slots, fallback


@dataclass
class ControllerSettings:
    max_k: int
    policy: str = "goodput"
    static_k: int | None = None
    forgetting: float = FORGETTING
    prior_strength: float = PRIOR_STRENGTH
    initial_acceptance: float = INITIAL_ACCEPTANCE
    min_gain: float = 0.02
    probe_k: int = 1
    probe_interval: int = 4
    probe_max_interval: int = 32
    # False: live step times do not correct the profile's prices.
    profile_correction: bool = True


@dataclass
class ControllerStats:
    steps: int = 0
    sum_k_step: int = 0
    request_steps: int = 0
    granted_slots: int = 0
    fallback_request_steps: int = 0
    probes_sent: int = 0
    probes_succeeded: int = 0
    plain_probes: int = 0
    recoveries: int = 0
    drafted: int = 0
    accepted: int = 0
    # k_counts[k]: request-steps that were granted k drafts.
    k_counts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))

    @property
    def k_histogram(self) -> dict[int, int]:
        return {k: int(n) for k, n in enumerate(self.k_counts.tolist()) if n}


class SpecController:
    """Per-request state is a set of arrays indexed by the estimator's row.

    A decision for a batch of 64 is then a few dozen array operations instead
    of a Python loop over requests: it runs inside ``schedule()`` every step.
    """

    # Per-position acceptance a probe is hoping for.
    PROBE_OPTIMISM = 0.9
    # Plans after which a probe with no verification counts as failed: the
    # probe's drafts are verified one step after it is planned, and observed
    # one step later still under async scheduling.
    PROBE_TIMEOUT = 3
    # Plain steps a plain probe runs (``_plain_probe``).
    PLAIN_PROBE_STEPS = 16

    def __init__(self, settings: ControllerSettings, profile: StepProfile | None = None):
        if settings.max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.settings = settings
        width = max(settings.max_k, 1)
        self.estimator = AcceptanceEstimator(
            width,
            forgetting=settings.forgetting,
            prior_strength=settings.prior_strength,
            initial_acceptance=settings.initial_acceptance,
        )
        if profile is None:
            profile = prior_profile("cpu", UNKNOWN_DRAFT_RATIO, 64 * (width + 1), 64)
        self.pricer = StepPricer(profile, ProfileCorrection())
        check = profile.meta.get("start_check")
        if check and settings.profile_correction:
            self.pricer.correction.seed(check["plain_batches"], check["repeats"],
                                        check["plain"], check["drafting"])
        self.goodput = GoodputPolicy(min_gain=settings.min_gain)
        static_k = settings.max_k if settings.static_k is None else settings.static_k
        self.static = StaticPolicy(min(static_k, settings.max_k))
        self.heuristic = HeuristicPolicy(initial_k=settings.max_k, max_k=settings.max_k)
        self._row_of = self.estimator.row_of  # req_id -> row, kept by the estimator
        self._last_ids: list[str] | None = None
        self._alloc(self.estimator.capacity)
        self.stats = ControllerStats(k_counts=np.zeros(settings.max_k + 1, dtype=np.int64))
        self.last_decision: Decision | None = None
        self.calibration = ConfidenceCalibration(width)
        # The survival a probe hopes for (PROBE_OPTIMISM per position).
        self._hope = self.PROBE_OPTIMISM ** np.arange(1.0, width + 1)
        # The last plan's rows, ceilings and prices (``stop_rule``).
        self._last_plan: tuple | None = None
        # A plain probe's request band and the plain steps it has left; the
        # correction's observations before the next may start.
        self._plain_probe_band, self._plain_probe_left = -1, 0
        self._plain_probe_after = self.PLAIN_PROBE_STEPS

    @property
    def profile(self) -> StepProfile:
        return self.pricer.profile

    def set_profile(self, profile: StepProfile) -> None:
        """Price from ``profile`` from now on (the live correction is kept)."""
        self.pricer = StepPricer(profile, self.pricer.correction)

    def ceiling(self, req_id: str) -> int | None:
        """A live request's ceiling on drafts, or None if it is not tracked."""
        row = self._row_of.get(req_id)
        return None if row is None else int(self._ceiling[row])

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate the per-row arrays, keeping what they hold."""
        s = self.settings
        for name, fill in (("_ceiling", 0), ("_fixed", -1), ("_backoff", s.probe_interval),
                           ("_waited", 0),
                           ("_probe_at", -1), ("_probe_size", s.probe_k), ("_probe_ok", 0),
                           ("_in_fallback", 0)):
            old = getattr(self, name, None)
            new = np.full(capacity, fill, dtype=np.int64)
            if old is not None:
                new[: old.size] = old
            setattr(self, name, new)
        self.heuristic.ensure_capacity(capacity)

    # -- request lifecycle -------------------------------------------------
    def add_request(self, req_id: str, ceiling: int | None = None,
                    fixed_k: int | None = None) -> None:
        """Track a request; ``ceiling``: its cap on drafts; ``fixed_k``: drafts
        it asked for exactly (``specplug_k``), or None for the adaptive choice."""
        if req_id in self._row_of:
            return
        s = self.settings
        row = self.estimator.add(req_id)
        if row >= self._ceiling.size:
            self._alloc(self.estimator.capacity)
        self._ceiling[row] = s.max_k if ceiling is None else min(ceiling, s.max_k)
        self._fixed[row] = -1 if fixed_k is None else min(fixed_k, self._ceiling[row])
        self._reset_probe(np.array([row]))
        # A new request's own drafts are untested: its first step in
        # fallback sends a probe, without waiting out a back-off.
        self._waited[row] = s.probe_interval
        self._probe_ok[row] = 0
        self._in_fallback[row] = 0
        self._last_ids = None
        self.heuristic.reset(row)

    def set_ceiling(self, req_id: str, ceiling: int, fixed_k: int | None = None) -> None:
        """Change a live request's ceiling (0 turns its speculation off) and fixed k."""
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._ceiling[row] = max(0, min(int(ceiling), self.settings.max_k))
        self._fixed[row] = -1 if fixed_k is None else min(max(int(fixed_k), 0), self._ceiling[row])
        self._last_ids = None

    def forget_acceptance(self, req_ids) -> None:
        """Start these requests' acceptance estimates again from the pool's.

        For requests whose drafts no longer come from what was observed (the
        draft's KV went stale under them)."""
        self.estimator.reset(list(req_ids))

    def finish_request(self, req_id: str) -> None:
        row = self._row_of.get(req_id)
        if row is None:
            return
        self._in_fallback[row] = 0
        self._last_ids = None
        self.estimator.remove(req_id)

    def num_requests(self) -> int:
        return len(self._row_of)

    def num_in_fallback(self) -> int:
        # Freed rows are cleared in finish_request, so all rows can be counted.
        return int(np.count_nonzero(self._in_fallback))

    def rows(self, req_ids: list[str]) -> np.ndarray:
        """The estimator's rows of the tracked requests among ``req_ids``, in order."""
        # The batch is usually the same list of requests step after step:
        # comparing the lists (same string objects) is far cheaper than
        # looking every id up again.
        if req_ids == self._last_ids:
            return self._last_rows
        get = self._row_of.get
        rows = [get(r) for r in req_ids]
        if None in rows:
            for r in req_ids:
                self.add_request(r)
            rows = [self._row_of[r] for r in req_ids]
        self._last_ids = list(req_ids)
        self._last_rows = np.array(rows, dtype=np.intp)
        return self._last_rows

    # -- learning ----------------------------------------------------------
    def observe_verification(self, req_id: str, drafted: int, accepted: int) -> None:
        self.observe_verifications([req_id], [drafted], [accepted])

    def observe_verifications(self, req_ids, drafted, accepted) -> None:
        """One step's verification outcome for many requests at once.

        ``drafted[i]`` drafts were verified for ``req_ids[i]`` and the first
        ``accepted[i]`` of them were kept.  Unknown (finished) requests and
        entries with nothing drafted are ignored.
        """
        d, a = np.asarray(drafted), np.asarray(accepted)
        if (isinstance(req_ids, list) and d.dtype.kind in "iu" and a.dtype.kind in "iu"
                and d.shape == a.shape == (len(req_ids),) and req_ids == self._last_ids):
            # The batch just planned (the usual case): its rows are known.
            rows, drafted, accepted, n_drafted, n_accepted = _verified(
                self._last_rows, d.astype(np.int64, copy=False), a.astype(np.int64, copy=False))
        else:
            get = self._row_of.get
            known = [(get(r), d, a) for r, d, a in zip(req_ids, drafted, accepted)
                     if d > 0 and get(r) is not None]
            if not known:
                return
            rows, drafted, accepted, n_drafted, n_accepted = _verified(
                *(np.array(x, dtype=np.int64) for x in zip(*known)))
        if not rows.size:
            return
        self.estimator.observe_rows(rows, drafted, accepted)
        if self.settings.policy == "heuristic":
            self.heuristic.observe(rows, drafted, accepted)
        self.stats.drafted += n_drafted
        self.stats.accepted += n_accepted
        s = self.settings
        self.stats.probes_succeeded += _probe_verdicts(
            rows, drafted, accepted, s.probe_k, s.probe_max_interval, self._ceiling,
            self._backoff, self._probe_at, self._probe_size, self._probe_ok)

    def observe_confidence(self, confidences: list, accepted: list) -> None:
        """Verified drafts with the draft's confidence in each (``ConfidenceCalibration``)."""
        self.calibration.observe(confidences, accepted)

    def observe_step(self, batch: int, tokens: int, k_step: int, seconds: float,
                     catchup_tokens: int = 0) -> bool:
        """A finished step's wall time: it corrects the profile's price of its shape."""
        if not self.settings.profile_correction:
            return False
        return self.pricer.observe(tokens, batch, k_step, seconds, catchup_tokens)

    # -- deciding ----------------------------------------------------------
    def plan(
        self,
        req_ids: list[str],
        base_tokens: int | None = None,
        fixed_k_step: int | None = None,
        catchup_tokens: int = 0,
        tokens_left=None,
        catchup_if_plain: int | None = None,
    ) -> Decision:
        """K for each of ``req_ids`` (decoding requests) in the next step.

        ``base_tokens`` is the number of non-draft tokens the next step is
        expected to schedule (defaults to one per request).  ``fixed_k_step``
        pins K_step for proposers that need it (and for data parallelism).
        ``catchup_tokens``: tokens a draft model skipped (zero-cost fallback)
        and must process before it drafts again.  ``tokens_left``: per
        request, ``max_tokens`` less its output so far.  Drafts planned now
        are verified next step, which yields at most k + 1 tokens, and this
        step yields at least one: a request can use at most ``tokens_left -
        2`` drafts (one capped at 0 is not in fallback).
        ``catchup_if_plain``: the catch-up tokens pending after this step if
        it drafts nothing.  With ``tokens_left``, the catch-up and the
        draft's pass over a prefill chunk are spread over the tokens the
        batch has left and charged per token to plans that draft, and what a
        plain step adds to the catch-up is charged to plain decoding the
        same way (``GoodputPolicy``); without it nothing is charged.  The
        catch-up and the pass are in the predicted seconds of a plan that
        drafts.
        """
        batch = len(req_ids)
        if batch == 0:
            return Decision(k_step=fixed_k_step or 0, k=np.zeros(0, dtype=np.int64))
        rows = self.rows(req_ids)
        ceilings = self._ceiling[rows]
        policy = self.settings.policy
        caps = (None if tokens_left is None else
                np.maximum(np.asarray(tokens_left, dtype=np.int64) - 2, 0))
        # The static policy is vLLM's static K, a baseline: it drafts K up to
        # max_tokens as vLLM does.
        if caps is not None and policy != "static":
            ceilings = np.minimum(ceilings, caps)
        # Requests with a fixed k (``specplug_k``) get it, within their caps;
        # the policy plans the others as if those drafted none.
        fixed = self._fixed[rows]
        pinned = fixed >= 0
        forced = np.minimum(fixed, ceilings)
        if pinned.any():
            ceilings = np.where(pinned, 0, ceilings)
        base = float(batch if base_tokens is None else base_tokens)
        survival = prices = None
        if pinned.all():
            decision = Decision(k_step=0, k=np.zeros(batch, dtype=np.int64))
            self._last_plan = None
        elif policy == "static":
            decision = self.static.decide(ceilings, fixed_k_step)
        elif policy == "heuristic":
            decision = self.heuristic.decide(rows, ceilings, fixed_k_step)
        else:
            profile = self.pricer.profile
            catch_up = profile.catchup(catchup_tokens) if catchup_tokens else 0.0
            skip = (profile.catchup(catchup_if_plain) - catch_up
                    if catchup_if_plain and catchup_if_plain > catchup_tokens else 0.0)
            # What the draft has not seen buys drafting for the batch's tokens
            # left (those of a request past its last usable draft count as 2).
            horizon = (float(np.sum(caps)) + 2.0 * batch
                       if caps is not None and fixed_k_step is None else None)
            survival = self.estimator.survival(rows)
            prices = self.goodput.prices(batch, survival.shape[1], base, self.pricer,
                                         fixed_k_step, catch_up, horizon, skip)
            decision = self.goodput.decide_priced(survival, ceilings, prices)
            plain = self._plain_probe(batch, base, decision, prices)
            decision = plain or self._probe(rows, ceilings, decision, survival, prices)
            self._last_plan = (req_ids, rows, ceilings, prices, decision)
        if pinned.any():
            decision = self._with_fixed(decision, pinned, forced, fixed_k_step, survival, prices)
            ceilings = np.where(pinned, forced, ceilings)
        self._account(rows, ceilings, decision)
        self.last_decision = decision
        return decision

    def _with_fixed(self, decision, pinned, forced, fixed_k_step, survival, prices) -> Decision:
        """``decision`` with the fixed-k requests' drafts put in, priced when it was.

        A step where one of them drafts has no per-position stop rule: the
        draft loop runs K_step and every request keeps what it was granted."""
        k = np.where(pinned, forced, decision.k)
        if fixed_k_step is not None:
            k = np.minimum(k, fixed_k_step)
            k_step = fixed_k_step
        else:
            k_step = max(int(decision.k_step), int(k.max(initial=0)))
        if int(forced[pinned].max(initial=0)) > 0:
            self._last_plan = None
        if prices is None:
            return Decision(k_step=k_step, k=k)
        return self.goodput.price(survival, k, k_step, prices)

    def stop_rule(self) -> StopRule | None:
        """The last plan as a per-position stop (``DraftStopper``), or None.

        Only for a goodput plan that drafts and does not pin K_step: the
        draft loop may then run up to each request's ceiling and stops where
        the plan's own argmax, one position at a time, says the next position
        does not pay.  A request the plan left in fallback keeps none, and a
        probe keeps its size; the others may keep up to their ceilings.
        """
        last, self._last_plan = self._last_plan, None
        if last is None:
            return None
        req_ids, rows, ceilings, pr, decision = last
        if decision.k_step <= 0 or pr.fixed_k_step is not None or pr.by_n is None:
            return None
        k = decision.k
        probing = self._probe_at[rows] == self.stats.steps - 1
        caps = np.where((k == 0) | probing, k, ceilings)
        n = int(k.sum())
        # What each further verified draft adds to the step, up to every cap's worth.
        m = min(max(int(caps.sum()), n) + 1, pr.by_n.size)
        ratio = pr.ratios(m)
        slot_s = np.maximum(np.diff(pr.by_n[:m] * ratio[:m]), 0.0)
        n = min(n, ratio.size - 1)
        # The rate the argmax maximised: the plan's tokens over its decoding
        # seconds, the draft's unseen work owed per token.  Not the step's
        # predicted seconds: a prefill chunk's are the step's whatever is
        # drafted, and would price every pass of a prompt's step as paying.
        tokens = decision.predicted_tokens
        seconds = (pr.by_n[n] + (decision.k_step - 1) * pr.draft_pass) * ratio[n]
        rate = tokens / max(float(seconds) + pr.owed * tokens, 1e-12)
        return StopRule(list(req_ids), self.estimator.conditional(rows), caps.astype(np.int64),
                        *self.calibration.observed(), self.calibration.edges,
                        slot_cuts=rate * slot_s, pass_cut=rate * pr.draft_pass * ratio[n])

    # -- probes ------------------------------------------------------------
    def _reset_probe(self, rows: np.ndarray) -> None:
        s = self.settings
        self._backoff[rows] = s.probe_interval
        self._waited[rows] = 0
        self._probe_at[rows] = -1
        self._probe_size[rows] = s.probe_k

    def _plain_probe(self, batch, base, decision, prices) -> Decision | None:
        """A plain step instead of ``decision`` while a plain probe runs, else None.

        The correction learns a plain step's price only from plain steps of
        its batch size (its request band); where the plan drafts every step
        none runs, and the price stays the profile's times errors learnt at
        other sizes, which can be wrong in either direction (a CPU's plain
        step at four requests was measured faster than at one).  So when a
        decoding step's plan drafts at a band that has seen less than one
        plain step lately (``ProfileCorrection.plain_seen``, forgotten as
        its price is), and its predicted gain over plain is within what
        ``PLAIN_PROBE_STEPS`` plain steps can move that price (the
        correction's step each), the band runs that many plain steps, then
        the argmax decides again at the price they measured.  A plan that
        falls back by itself ends a probe.  A probe starts only once the
        correction has timed as many steps as a probe runs, and twice that
        since the last probe began: steps that are not timed (or not kept)
        teach it nothing, and probes of two bands never run back to back.
        The cost is a catch-up and the run's lost gain, once per band per
        forgetting time; a plan whose gain no such run could overturn is
        never probed.
        """
        corr = self.pricer.correction
        at = band(float(batch), corr.BATCH_BANDS)
        if decision.k_step <= 0:
            if at == self._plain_probe_band:
                self._plain_probe_left = 0
            return None
        if prices.fixed_k_step is not None or base > batch or not self.settings.profile_correction:
            return None
        if self._plain_probe_left > 0 and at == self._plain_probe_band:
            self._plain_probe_left -= 1
        elif (corr.plain_seen(batch) < 1.0 and corr.observations >= self._plain_probe_after
              and decision.predicted_speedup < math.exp(self.PLAIN_PROBE_STEPS * corr.step)):
            self._plain_probe_band, self._plain_probe_left = at, self.PLAIN_PROBE_STEPS - 1
            self._plain_probe_after = corr.observations + 2 * self.PLAIN_PROBE_STEPS
            self.stats.plain_probes += 1
        else:
            return None
        return self.goodput.price(None, np.zeros(batch, dtype=np.int64), 0, prices)

    def _probe(self, rows, ceilings, decision, survival, prices) -> Decision:
        """Send a small probe to requests that sat in fallback long enough.

        A request granted nothing while its ceiling allows drafts is in
        fallback; after ``backoff`` such steps (at once after an accepted
        probe, and on a new request's first step in fallback) it is due.  A
        probe goes out only when it could pay: the same argmax, with the due
        requests' drafts assumed good (``PROBE_OPTIMISM`` per position) and
        the same catch-up charges, must grant them slots; the probe is no
        deeper than that plan would grant, nor than the K_step of a plan
        that drafts.  Its verdict arrives a step later; one that never comes
        (``PROBE_TIMEOUT`` plans) counts as a failure.  Returns the plan to
        send: ``decision``, or the plan with the probes, priced.
        """
        s = self.settings
        due = np.zeros(rows.size, dtype=np.bool_)
        n_due, recoveries = _probe_due(
            rows, decision.k, ceilings, self.stats.steps, self.PROBE_TIMEOUT, s.probe_interval,
            s.probe_k, s.probe_max_interval, self._in_fallback, self._backoff, self._waited,
            self._probe_at, self._probe_size, self._probe_ok, due)
        self.stats.recoveries += recoveries
        if not n_due:
            return decision
        due_idx = np.flatnonzero(due)
        k = decision.k.copy()
        now = self.stats.steps
        plan = self.goodput.decide_hoping(survival, ceilings, due, self._hope, prices)
        depth = int(plan.k[due_idx].max(initial=0))
        pinned = prices.fixed_k_step is not None
        if decision.k_step > 0 and not pinned:
            depth = min(depth, decision.k_step)
        if depth <= 0:
            return decision
        due_rows = rows[due_idx]
        probe_k = np.minimum(np.minimum(self._probe_size[due_rows], ceilings[due_idx]), depth)
        k[due_idx] = probe_k
        self._probe_at[due_rows] = now
        self._waited[due_rows] = 0
        self.stats.probes_sent += int(due_idx.size)
        k_step = decision.k_step if pinned else max(decision.k_step, int(probe_k.max()))
        # The plan as sent, probes and all, is what is priced.
        return self.goodput.price(survival, k, k_step, prices)

    def _account(self, rows: np.ndarray, ceilings: np.ndarray, decision: Decision) -> None:
        s = self.stats
        slots, fallback = _count_plan(decision.k, ceilings, s.k_counts)
        s.steps += 1
        s.sum_k_step += int(decision.k_step)
        s.request_steps += rows.size
        s.granted_slots += int(slots)
        s.fallback_request_steps += int(fallback)


def warm_up(settings: ControllerSettings, profile: StepProfile) -> None:
    """Run every compiled kernel once on a throwaway controller.

    The policy's and estimator's numba kernels compile on first use (about
    a second cold, a fraction with numba's cache): a server calls this at
    start-up so that its first requests do not wait for it."""
    ctrl = SpecController(settings, profile)
    ids = ["warm-0", "warm-1"]
    for rid in ids:
        ctrl.add_request(rid)
    for _ in range(3):
        d = ctrl.plan(ids)
        k = np.asarray(d.k, dtype=np.int64)
        ctrl.observe_verifications(ids, k, k // 2)
        ctrl.observe_step(len(ids), len(ids) + int(k.sum()), int(d.k_step), 1.0)
    # A probe's kernels run only when a probe is due.
    policy, survival = ctrl.goodput, ctrl.estimator.survival(ctrl.rows(ids))
    ceilings = np.full(len(ids), max(settings.max_k, 1), dtype=np.int64)
    prices = policy.prices(len(ids), survival.shape[1], float(len(ids)), ctrl.pricer)
    policy.decide_priced(survival, ceilings, prices)
    policy.decide_hoping(survival, ceilings, np.array([True, False]), ctrl._hope, prices)
    policy.price(survival, np.ones(len(ids), dtype=np.int64), 1, prices)
    for rid in ids:
        ctrl.finish_request(rid)

