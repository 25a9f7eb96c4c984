"""Re-probing requests in fallback, and plain probes of a plain step's price.

A request granted no drafts while its ceiling allows some is in fallback; it
is re-probed with a small draft on a doubling back-off, and only when the
profile says good drafts would pay (``Probes._probe``).  The one price the
correction cannot learn by itself, a plain step at a batch size where the
plan always drafts, a short run of plain steps measures
(``Probes._plain_probe``).  ``SpecController`` inherits ``Probes``: the
per-request probe state is its per-row arrays (``_backoff``, ``_waited``,
``_probe_at``, ``_probe_size``, ``_probe_ok``, ``_in_fallback``).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from vllm_specplug.controller.correction import band
from vllm_specplug.controller.pricing import Decision


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


class Probes:
    """``SpecController``'s probes (its per-row arrays, settings, stats, pricer and
    goodput policy)."""

    # Per-position acceptance a probe is hoping for.
    # Source: 5feab62 (the depth it caps: simulated 70B + 1B c=128 0.89 -> 0.98 of
    # static K=1); constants_sweep.py at 59dd374: 0.7 and 1.0 each cost a cell 0.031.
    PROBE_OPTIMISM = 0.9
    # Plans after which a probe with no verification counts as failed: the
    # probe's drafts are verified one step after it is planned, and observed
    # one step later still under async scheduling.
    # Not tuned: the verdict lag (59846f7).
    PROBE_TIMEOUT = 3
    # Plain steps a plain probe runs (``_plain_probe``).
    # Source: the plain-probe tests (test_controller.py); not swept.
    PLAIN_PROBE_STEPS = 16

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
