"""The controller's per-step loops, compiled with numba when it is installed.

``GoodputPolicy.decide`` and the controller's probe bookkeeping run inside
vLLM's ``schedule()`` every step, the acceptance estimator's update inside
``update_from_output()``.  Their NumPy forms cost tens of
microseconds each on a small CPU, nearly all of it the fixed cost of each
NumPy call and Python statement, not arithmetic (a batch of 64 with a
ceiling of 8 is 512 numbers).  The same loops compiled cost a few
microseconds.  numba comes with vLLM (its n-gram proposer is written in
it), so it is there wherever the plugin runs; it is not a dependency of the
controller, which stays importable and testable without it.

``best_plan``, ``advance_probes`` and ``refresh_survival`` are None when
numba is missing, when it fails to compile them, or when ``VLLM_SPECPLUG_NUMBA=0``; the controller
then runs its NumPy paths, which are also the references the tests compare
these with, decision for decision.  The compiled code is cached on disk (numba's ``cache=True``), so
only the first process on a machine pays the compilation (about 2 s here).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np

logger = logging.getLogger(__name__)

best_plan = None
advance_probes = None
refresh_survival = None

if os.environ.get("VLLM_SPECPLUG_NUMBA", "1") != "0":
    try:
        import numba
    except ImportError:  # the controller works without it, only slower
        numba = None

    if numba is not None:

        @numba.njit(cache=True, nogil=True)
        def _best_plan(s, fixed_k_step, rounds, lam, a0, a_tok, a_pass, t_plain, share,
                       optimism, c00, c01, c02, c11, c12, c22, room, knee_slope, pass_offset,
                       k_out):
            """GoodputPolicy.decide's Dinkelbach rounds and final plan, in one loop.

            Same arithmetic as the NumPy path (``GoodputPolicy._best_j``,
            ``_knee_plans`` and ``StepCostModel.predict_lower``): ``rounds``
            rounds at point estimates, then the plan at lower confidence
            bounds.  ``room``: tokens the step can add before the cost
            model's knee, past which a token costs ``knee_slope`` more.
            ``pass_offset``: draft passes a K_step = 0 step runs anyway
            (``StepCostModel.pass_offset``); K_step = j adds j minus that.
            Fills ``k_out`` with each request's slots and returns (K_step,
            expected tokens, slots, decode seconds).
            """
            batch, width = s.shape
            n_cum = np.zeros(width + 1)
            gain_cum = np.zeros(width + 1)
            thr = np.zeros(width + 1)
            vals = np.empty(batch * width)
            poss = np.empty(batch * width, dtype=np.int64)
            j_lo = 0 if fixed_k_step < 0 else fixed_k_step
            j_hi = width if fixed_k_step < 0 else fixed_k_step
            past0 = max(-room, 0.0)
            best_j, best_tokens, best_n, best_sec, best_thr = 0, 0.0, 0.0, 0.0, 0.0
            r = 0
            while True:
                optimistic = r == rounds
                bar = lam * a_tok
                for p in range(width):
                    count, gain = 0.0, 0.0
                    for b in range(batch):
                        v = s[b, p]
                        if (v >= bar) if bar > 0 else (v > 0.0):
                            count += 1.0
                            gain += v
                    n_cum[p + 1] = n_cum[p] + count
                    gain_cum[p + 1] = gain_cum[p] + gain
                    thr[p + 1] = bar if bar > 0 else 0.0
                if knee_slope > 0 and room < n_cum[width]:
                    # _knee_plans: the worth slots by survival, largest first.
                    bar_hi = lam * (a_tok + knee_slope)
                    m = 0
                    for b in range(batch):
                        for p in range(width):
                            v = s[b, p]
                            if (v >= bar) if bar > 0 else (v > 0.0):
                                vals[m] = -v
                                poss[m] = p
                                m += 1
                    order = np.argsort(vals[:m], kind="mergesort")
                    for j in range(max(j_lo, 1), j_hi + 1):
                        n_lo = 0
                        n_hi = 0
                        for i in range(m):
                            if poss[order[i]] < j:
                                n_lo += 1
                                if -vals[order[i]] >= bar_hi:
                                    n_hi += 1
                        if room >= n_lo:
                            n = n_lo
                        else:
                            n = max(n_hi, int(max(room, 0.0)))
                        if n < n_lo:
                            gain, t, taken = 0.0, np.inf, 0
                            for i in range(m):
                                if taken == n:
                                    break
                                if poss[order[i]] < j:
                                    gain += -vals[order[i]]
                                    t = -vals[order[i]]
                                    taken += 1
                            gain_cum[j] = gain
                            thr[j] = t
                        elif n > 0:
                            t = np.inf
                            for i in range(m):
                                if poss[order[i]] < j:
                                    t = -vals[order[i]]
                            thr[j] = t
                        else:
                            thr[j] = np.inf
                        n_cum[j] = n
                best_net = -np.inf
                for j in range(j_lo, j_hi + 1):
                    pj = max(j - pass_offset, 0)
                    if not optimistic:
                        sec = t_plain + a_tok * n_cum[j] + a_pass * pj
                    elif j == 0:
                        sec = t_plain  # plain decoding is judged at its point estimate
                    else:
                        # predict_lower's bound, floored halfway from a plain step.
                        tokens = batch + n_cum[j]
                        sec = a0 + a_tok * tokens + a_pass * pj
                        if optimism > 0.0:
                            var = (c00 + tokens * (2.0 * c01 + c11 * tokens)
                                   + pj * (2.0 * c02 + c22 * pj + (2.0 * c12) * tokens))
                            sec = max(sec - optimism * math.sqrt(max(var, 0.0)),
                                      0.5 * (a0 + a_tok * batch + sec))
                    if knee_slope > 0 and j > 0:
                        sec += knee_slope * (max(n_cum[j] - room, 0.0) - past0)
                    if share > 0 and j > 0:
                        sec += share
                    sec = max(sec, 1e-12)
                    net = gain_cum[j] - lam * (sec - t_plain)
                    if (fixed_k_step < 0 and j > 0 and n_cum[j] == n_cum[j - 1]
                            and gain_cum[j] == gain_cum[j - 1]):
                        net = -np.inf  # a draft pass for no slot (see _best_j)
                    if net > best_net:
                        best_net = net
                        best_j, best_tokens, best_n, best_sec = j, batch + gain_cum[j], n_cum[j], sec
                        best_thr = thr[j]
                if optimistic:
                    break
                rate = best_tokens / best_sec if best_sec > 0 else 0.0
                if rate <= lam * (1.0 + 1e-6):
                    r = rounds
                else:
                    lam = rate
                    r += 1
            for b in range(batch):
                count_b = 0
                for p in range(best_j):
                    v = s[b, p]
                    if v > 0.0 and v >= best_thr:
                        count_b += 1
                k_out[b] = count_b
            return best_j, best_tokens, int(best_n), best_sec

        @numba.njit(cache=True, nogil=True)
        def _advance_probes(k, ceilings, rows, state, dirty, now, probe_k, probe_interval,
                            probe_max_interval, timeout, due_out):
            """SpecController._advance_probe_state's NumPy path, request by request.

            ``state`` columns as SpecController._PROBE_FIELDS: back-off,
            steps waited, probing, probe sent at, probe size, last probe
            accepted, in fallback.  Writes the batch positions due a probe to
            ``due_out``; returns (how many, recoveries seen).
            """
            n_due = 0
            recoveries = 0
            for b in range(k.size):
                row = rows[b]
                fallback = k[b] == 0 and ceilings[b] > 0
                if not fallback and not dirty[row]:
                    continue
                probing = state[row, 2] != 0
                last_ok = state[row, 5] != 0
                if k[b] > 0:
                    if state[row, 6] != 0 and last_ok:
                        recoveries += 1
                    # Requests that speculate again start over.
                    state[row, 4] = probe_k
                    state[row, 0] = probe_interval
                    state[row, 1] = 0
                    last_ok = False
                if probing and now - state[row, 3] >= timeout:
                    state[row, 4] = probe_k
                    state[row, 0] = min(state[row, 0] * 2, probe_max_interval)
                    probing = False
                    last_ok = False
                waiting = fallback and not probing
                if waiting:
                    state[row, 1] += 1
                    if state[row, 1] >= state[row, 0] or last_ok:
                        due_out[n_due] = b
                        n_due += 1
                state[row, 6] = 1 if fallback else 0
                state[row, 2] = 1 if probing else 0
                state[row, 5] = 1 if last_ok else 0
                dirty[row] = fallback or probing or last_ok
            return n_due, recoveries

        @numba.njit(cache=True, nogil=True)
        def _refresh_survival(counts, rows, profile, prior_share, prior_strength, tie_break,
                              surv):
            """AcceptanceEstimator._refresh_survival's NumPy path, row by row.

            alpha_p = (successes_p + share_p * profile_p + (m / 2) * alpha_{p-1})
            / (trials_p + m), the recurrence the NumPy path solves in closed
            form; survival is its running product.
            """
            half_m = 0.5 * prior_strength
            for i in range(rows.size):
                row = rows[i]
                alpha, survival = 0.0, 1.0
                for p in range(profile.size):
                    inv = 1.0 / (counts[row, 1, p] + prior_strength)
                    alpha = (counts[row, 0, p] + prior_share[p] * profile[p]) * inv + (
                        half_m * inv * alpha if p > 0 else 0.0)
                    survival *= alpha
                    surv[row, p] = survival - row * tie_break

        try:
            # Compile (or load from the cache) now, at start-up, not inside
            # the first scheduled step.
            _best_plan(np.ones((1, 1)), -1, 1, 1.0, 1.0, 0.1, 0.1, 1.1, 0.0, 1.0,
                       0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e300, 0.0, 0, np.zeros(1, dtype=np.int64))
            _advance_probes(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64),
                            np.zeros(1, dtype=np.intp), np.zeros((1, 7), dtype=np.int64),
                            np.zeros(1, dtype=bool), 0, 1, 4, 32, 3,
                            np.zeros(1, dtype=np.int64))
            _refresh_survival(np.zeros((1, 2, 1)), np.zeros(1, dtype=np.intp), np.ones(1),
                              np.ones(1), 1.0, 0.0, np.zeros((1, 1)))
            best_plan = _best_plan
            refresh_survival = _refresh_survival
            advance_probes = _advance_probes
        except Exception:  # noqa: BLE001 - any compiler failure: use NumPy
            logger.warning("vllm-specplug: numba could not compile the controller's loops; "
                           "using the NumPy path (slower decisions, same results)",
                           exc_info=True)
