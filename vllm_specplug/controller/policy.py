"""Policies: how many draft slots each request gets in the next step.

Every policy answers the same question: for a batch of ``B`` decoding
requests with per-request ceilings, return ``k[r]`` (drafts to verify for
request ``r`` next step) and ``K_step`` (how many draft positions the
proposer runs), with ``k[r] <= K_step <= max_k``.  Each takes what it needs
(``SpecController.plan`` calls each with its own): the goodput policy the
survival estimates and the step's prices, the static one the ceilings, the
heuristic one its per-request state.

- ``GoodputPolicy`` (the default): one argmax of expected tokens per second
  over K_step and the number of admitted slots, priced from the step-cost
  profile.
- ``StaticPolicy`` is fixed K, the baseline everyone runs today.
- ``HeuristicPolicy`` is Hugging Face assisted generation's rule: +2 after a
  fully accepted draft, -1 otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

from vllm_specplug.controller.correction import ProfileCorrection
from vllm_specplug.controller.profile import StepProfile, convex_rise


@numba.njit(cache=True)
def _candidates(survival, ceilings):
    """The slots a plan may admit, most likely first (equal ones in row-major
    order): their survivals, requests and positions, and the deepest position.

    A stable sort: survivals spread over [0, 1] are bucketed by value, which
    leaves little for an insertion sort to do; where that would take long,
    a merge sort of the runs of non-increasing survival (rows, as the
    estimator's are) does it in log2(runs) passes.
    """
    batch, width = survival.shape
    vals = np.empty(batch * width)
    slot = np.empty(batch * width, dtype=np.int64)  # r * width + p
    starts = np.empty(batch * width + 1, dtype=np.int64)  # of the runs
    n = runs = deepest = 0
    for r in range(batch):
        for p in range(min(width, max(ceilings[r], 0))):
            v = survival[r, p]
            if v > 0.0:
                if n == 0 or v > vals[n - 1]:
                    starts[runs] = n
                    runs += 1
                vals[n], slot[n] = v, r * width + p
                deepest = max(deepest, p)
                n += 1
    starts[runs] = n
    vals, slot = vals[:n], slot[:n]
    out_vals, out_slot = _bucket_sort(vals, slot)
    if out_vals.size < n:
        out_vals, out_slot = _merge_runs(vals, slot, starts, runs)
    return out_vals, out_slot // width, out_slot % width, deepest


@numba.njit(cache=True)
def _bucket_sort(vals, slot):
    """``vals`` (and ``slot``) stably sorted, most first, or empty arrays if
    the insertion sort would take more than a few moves per slot."""
    n = vals.size
    bucket = np.empty(n, dtype=np.int64)
    count = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):  # non-decreasing as the survival decreases
        x = (1.0 - vals[i]) * n
        bucket[i] = 0 if x < 0.0 else (n - 1 if x >= n - 1 else int(x))
        count[bucket[i] + 1] += 1
    for b in range(n):
        count[b + 1] += count[b]
    out_vals, out_slot = np.empty(n), np.empty(n, dtype=np.int64)
    for i in range(n):  # in order within a bucket
        o = count[bucket[i]]
        out_vals[o], out_slot[o] = vals[i], slot[i]
        count[bucket[i]] += 1
    moves = 0
    for i in range(1, n):
        v, s = out_vals[i], out_slot[i]
        o = i
        while o > 0 and out_vals[o - 1] < v:
            out_vals[o], out_slot[o] = out_vals[o - 1], out_slot[o - 1]
            o -= 1
        out_vals[o], out_slot[o] = v, s
        moves += i - o
        if moves > 4 * n:
            return out_vals[:0], out_slot[:0]
    return out_vals, out_slot


@numba.njit(cache=True)
def _merge_runs(vals, slot, starts, runs):
    """Stable merge sort, most first, of ``vals`` (and ``slot``) whose ``runs``
    non-increasing runs start at ``starts`` (then ``len(vals)``)."""
    n = vals.size
    starts = starts.copy()
    vals, slot = vals.copy(), slot.copy()
    to_vals, to_slot = np.empty(n), np.empty(n, dtype=np.int64)
    while runs > 1:
        merged = 0
        for i in range(0, runs, 2):
            lo, mid = starts[i], starts[i + 1]
            hi = starts[i + 2] if i + 2 <= runs else mid
            a, b = lo, mid
            for o in range(lo, hi):
                # The later run's slot goes first only if strictly more likely.
                if b < hi and (a == mid or vals[b] > vals[a]):
                    to_vals[o], to_slot[o] = vals[b], slot[b]
                    b += 1
                else:
                    to_vals[o], to_slot[o] = vals[a], slot[a]
                    a += 1
            starts[merged] = lo
            merged += 1
        starts[merged] = n
        runs = merged
        vals, to_vals, slot, to_slot = to_vals, vals, to_slot, slot
    return vals, slot


@numba.njit(cache=True)
def _best_plan(vals, rows, at, by_n, ratio, batch, j_first, j_last, draft_pass, owed, k):
    """The argmax of expected tokens per second over K_step j in [j_first, j_last]
    and n, the plan that admits the n most likely slots at positions below j.

    Plans are visited K_step by K_step, each along the sorted slots, and the
    first of equal rates wins.  Returns K_step, n, the rate, its seconds and
    its expected accepted drafts; fills ``k`` (per request) with its slots.
    """
    best, best_j, best_n, best_s, best_g = 0.0, j_first, 0, 0.0, 0.0
    first = True
    cut = -np.inf  # below cut * seconds, tokens are certainly a worse rate than the best
    for j in range(j_first, j_last + 1):
        passes = (j - 1) * draft_pass
        n, gain = 0, 0.0
        for m in range(vals.size):
            if at[m] < j:
                n += 1
                gain += vals[m]
            elif m > 0:
                continue  # the same plan as the slot before
            seconds = max((by_n[n] + passes) * ratio[n], 1e-12)
            tokens = batch + gain
            per = seconds + owed * tokens
            if per > 0.0 and tokens < cut * per:
                # Short of the best by 1e-12, far more than rounding: the
                # division (the loop's cost) could only say so.
                continue
            rate = tokens / per
            if first or rate > best or (math.isnan(rate) and not math.isnan(best)):
                best, best_j, best_n, best_s, best_g = rate, j, n, seconds, gain
                cut = best * (1.0 - 1e-12) if best > 0.0 else -np.inf
                first = False
    taken = 0
    for m in range(vals.size):
        if taken == best_n:
            break
        if at[m] < best_j:
            k[rows[m]] += 1
            taken += 1
    return best_j, best_n, best, best_s, best_g


@numba.njit(cache=True)
def _with_rows_replaced(vals, rows, at, due, hope, ceilings):
    """``_candidates`` of the survival with the ``due`` requests' rows replaced by
    ``hope`` (strictly decreasing along positions), from the candidates of the
    survival before (``vals``, ``rows``, ``at``): their slots are dropped and
    the hoped-for ones merged in, in the same order (most likely first, equal
    ones in row-major order)."""
    width = hope.size
    n_old = vals.size
    keep = np.empty(n_old, dtype=np.int64)
    n_keep = 0
    for m in range(n_old):
        if not due[rows[m]]:
            keep[n_keep] = m
            n_keep += 1
    # The hoped-for slots, most likely first: by position, then by request.
    n_new = 0
    for r in range(due.size):
        if due[r]:
            n_new += min(width, max(ceilings[r], 0))
    new_rows = np.empty(n_new, dtype=np.int64)
    new_at = np.empty(n_new, dtype=np.int64)
    n = 0
    for p in range(width):
        if hope[p] <= 0.0:
            break
        for r in range(due.size):
            if due[r] and p < ceilings[r]:
                new_rows[n], new_at[n] = r, p
                n += 1
    total = n_keep + n
    out_vals, out_rows, out_at = np.empty(total), np.empty(total, dtype=np.int64), \
        np.empty(total, dtype=np.int64)
    a = b = deepest = 0
    for o in range(total):
        take_old = b >= n
        if not take_old and a < n_keep:
            m = keep[a]
            v_new = hope[new_at[b]]
            take_old = vals[m] > v_new or (vals[m] == v_new and rows[m] * width + at[m]
                                           < new_rows[b] * width + new_at[b])
        if take_old:
            m = keep[a]
            out_vals[o], out_rows[o], out_at[o] = vals[m], rows[m], at[m]
            a += 1
        else:
            out_vals[o], out_rows[o], out_at[o] = hope[new_at[b]], new_rows[b], new_at[b]
            b += 1
        deepest = max(deepest, out_at[o])
    return out_vals, out_rows, out_at, deepest


@numba.njit(cache=True)
def _slots_gain(survival, k):
    """The survivals of the slots ``k`` grants (the first ``k[r]`` of each row), summed."""
    gain = 0.0
    for r in range(k.size):
        for p in range(k[r]):
            gain += survival[r, p]
    return gain


@dataclass
class Decision:
    k_step: int
    k: np.ndarray  # per request, same order as the batch
    predicted_seconds: float = float("nan")
    predicted_tokens: float = float("nan")
    plain_seconds: float = float("nan")
    plain_tokens: float = float("nan")

    @property
    def predicted_speedup(self) -> float:
        if not (self.predicted_seconds > 0 and self.plain_seconds > 0):
            return float("nan")
        return (self.predicted_tokens / self.predicted_seconds) / (
            self.plain_tokens / self.plain_seconds
        )


class StepPricer:
    """The profile with its live correction: seconds of a planned step."""

    def __init__(self, profile: StepProfile, correction: ProfileCorrection | None = None) -> None:
        self.profile = profile
        self.correction = correction or ProfileCorrection()

    def seconds(self, tokens: float, batch: int, k_step: int, catchup_tokens: float = 0.0) -> float:
        raw = self.profile.step(tokens, batch, k_step, catchup_tokens)
        return raw * self.correction.ratio(tokens, batch, plain=k_step == 0)

    def observe(self, tokens: float, batch: int, k_step: int, seconds: float,
                catchup_tokens: float = 0.0) -> bool:
        raw = self.profile.step(tokens, batch, k_step, catchup_tokens)
        return self.correction.observe(tokens, batch, raw, seconds, plain=k_step == 0)


@dataclass
class _Prices:
    """One step's prices for ``GoodputPolicy.decide_priced`` (``GoodputPolicy.prices``)."""
    batch: int
    fixed_k_step: int | None
    plain_full: float    # the plain step, prefill chunk included
    prefill_p: float     # the prefill chunk's profiled target seconds
    prefill_s: float     # ... at the plain step's correction
    unseen_s: float      # catch-up and draft prefill, paid by a drafting plan
    owed: float          # unseen_s per token yielded (0 without a horizon)
    plain: float         # plain decoding's seconds, without the prefill chunk
    plain_charged: float # ... plus its share of what skipping the draft adds
    by_n: np.ndarray | None = None   # a drafting step's decode seconds by slots verified
    ratios: Callable[[int], np.ndarray] | None = None  # its correction, for 0..n-1 slots
    draft_pass: float = 0.0


class GoodputPolicy:
    """Draft slots where they raise expected tokens per second; one argmax.

    A slot is (request r, draft position p); its value is the survival
    probability s[r, p], the chance that drafts 1..p are all accepted, so a
    request given j slots yields 1 + s[r, 0] + ... + s[r, j-1] tokens.  For
    every K_step j and every n, the plan that admits the n most likely slots
    at positions below j is priced from the profile as the step that carries
    it: the target over the step's tokens plus the n drafts, and j draft
    positions.  (vLLM verifies the drafts planned now in the next step, and
    that step drafts for the one after it: in steady state each step both
    verifies a plan and runs its draft positions, which is what is priced.)
    The plan with the most tokens per second wins; plain decoding (j = 0)
    unless it beats plain by ``min_gain``.  Low acceptance and a
    compute-bound batch both end there: no slot pays.

    Rates count decode work only: a prefill chunk in the step costs the same
    whatever is drafted, so its time (the profiled plain step's with the
    chunk minus the plain step's without it, at each plan's own correction)
    is left out of every plan's seconds, while the drafts are still priced
    at the step's real size.

    With the zero-cost fallback a step that drafts nothing skips the draft
    too, so what the draft has not seen is paid for once, by the step that
    drafts past it: the catch-up (the draft re-run over what it skipped,
    from the first stale KV block) when drafting resumes, and, in a step
    that prefills, the draft's pass over the prefill chunk.  Drafting now or
    drafting later, that work buys drafting for the rest of the batch's
    tokens, so it is spread over them (``horizon`` tokens: ``SpecController.plan``)
    and every drafting plan is charged its share for each token it yields.
    A plain step is charged in the same way what it adds to the pending
    catch-up (the skipped tokens back to their KV block's start, which the
    draft had seen, and any prompt it prefills).  Leaving drafting and
    coming back thus costs a catch-up, and the argmax switches only when
    the other side is better by at least that share: the hysteresis of
    rent-or-buy, so estimates that wobble around break-even do not buy a
    catch-up each time.  A step that carries a new prompt drafts when
    drafting pays for the batch; resuming after a long fallback has to win
    its catch-up back before the requests end, and the charge never rises
    without bound.
    """

    name = "goodput"

    def __init__(self, min_gain: float = 0.02) -> None:
        # Speculation must promise at least this relative gain over plain
        # decoding: a bias toward plain decoding of estimates near 1.0x (it
        # moves break-even, it remembers nothing; the catch-up charge is what
        # keeps a choice near break-even under the zero-cost fallback).
        self.min_gain = min_gain
        self._cached_shape: tuple | None = None
        # The last decide_priced's survival, ceilings and candidates (decide_hoping).
        self._last_candidates: tuple | None = None

    def decide(
        self,
        survival: np.ndarray,
        ceilings: np.ndarray,
        base_tokens: float,
        pricer: StepPricer,
        fixed_k_step: int | None = None,
        catch_up_s: float = 0.0,
        horizon: float | None = None,
        skip_s: float = 0.0,
    ) -> Decision:
        """Best plan for ``survival`` (rows non-increasing along positions).

        ``base_tokens`` is what the step schedules besides drafts (one per
        decoding request plus prefill chunks).  ``fixed_k_step`` pins K_step
        (proposers that need a fixed K; lockstep data parallelism): then the
        argmax is over the slots only.  ``catch_up_s``: a pending catch-up,
        paid by a plan that drafts; with ``horizon`` (tokens), it and the
        draft's pass over a prefill chunk are charged per token yielded
        instead of to this step alone, and plain decoding is charged
        ``skip_s``, what skipping the draft in this step adds to the pending
        catch-up, the same way (without a horizon, nothing is charged).
        """
        prices = self.prices(*survival.shape, base_tokens, pricer, fixed_k_step, catch_up_s,
                             horizon, skip_s)
        return self.decide_priced(survival, np.asarray(ceilings), prices)

    def prices(self, batch: int, width: int, base_tokens: float, pricer: StepPricer,
               fixed_k_step: int | None = None, catch_up_s: float = 0.0,
               horizon: float | None = None, skip_s: float = 0.0) -> _Prices:
        """What ``decide`` prices, for ``decide_priced``: one step's shape, any survival."""
        profile, corr = pricer.profile, pricer.correction
        base = max(float(base_tokens), float(batch))
        shape = self._shape(profile, base, batch, width)
        prefill_p, prefill_f, plain_p, by_n, draft_pass = shape[4:]
        # Every plan of this step is priced at the correction of the step's
        # own shape, prefill chunk and all; the plain plan at a plain step's.
        ratio = corr.ratio(base, batch)
        plain_ratio = corr.ratio(base, batch, plain=True)
        # The plain step with its prefill chunk: at least the plain step without it.
        plain_full = (plain_p + prefill_p) * plain_ratio
        prefill_s = prefill_p * plain_ratio
        unseen_s = catch_up_s + prefill_f * ratio  # paid by drafting plans
        per_token = 1.0 / max(horizon, 1.0) if horizon is not None else 0.0
        pr = _Prices(batch, fixed_k_step, plain_full, prefill_p, prefill_s, unseen_s,
                     owed=unseen_s * per_token, plain=plain_full - prefill_s,
                     plain_charged=plain_full - prefill_s + skip_s * per_token * batch)
        if fixed_k_step == 0 or width == 0 or batch == 0:
            return pr
        pr.by_n, pr.draft_pass = by_n, draft_pass
        # The correction's ratios for the step's tokens and 0..all slots,
        # taken once per decision; a plan of n slots reads the first n + 1.
        full = []

        def ratios(count: int) -> np.ndarray:
            if not full:
                full.append(corr.ratios_from(int(base), by_n.size, batch=batch))
            return full[0][:count]

        pr.ratios = ratios
        return pr

    def _shape(self, profile: StepProfile, base: float, batch: int, width: int) -> tuple:
        """The profile's prices of a step shape, cached while the profile and the shape
        stay (a batch decoding step after step asks for the same one)."""
        cached = self._cached_shape
        if (cached is not None and cached[0] is profile and cached[1] == base
                and cached[2] == batch and cached[3] == width):
            return cached
        # The prefill chunk's share, not below zero: the token curves are the
        # measured medians, and a step over more tokens can measure cheaper
        # (see by_n below).
        plain_p = profile.target(batch)
        prefill_p = max(profile.target(base) - plain_p, 0.0)
        # The draft's pass over the prefill chunk, when a plain step would
        # skip it (zero-cost fallback); otherwise what drafting adds is the
        # step's own cost.
        prefill_f = (max(profile.first(base) - profile.first(batch), 0.0)
                     if profile.skips_draft_at_k0 else 0.0)
        by_n, draft_pass = None, 0.0
        if width and batch:
            # Profiled seconds of a drafting step's decode work by the number n
            # of slots it verifies (0..all), before the K_step-dependent draft
            # passes: the step less its prefill share.  Read from the step's
            # own size up (a smaller shape, a 1-token step measured slower
            # than a 4-token one, never raises this step's prices), and made
            # non-decreasing and convex in n (``convex_rise``): a verified
            # token does not cost less than the one before it, so a profile
            # point a repeat would not reproduce (one 2-token step measured
            # a third dearer than the 1- and 9-token steps) is spread over
            # its neighbours instead of pricing one place in every step.
            # Captured sizes (CUDA graphs) keep their real staircase: there
            # the curve is only made non-decreasing.
            tokens = base + np.arange(batch * width + 1, dtype=np.float64)
            raw = profile.verify_and_first(tokens)
            by_n = (np.maximum.accumulate(raw) if profile.pad_sizes is not None
                    else convex_rise(raw)) - prefill_p - prefill_f
            by_n.flags.writeable = False
            draft_pass = profile.draft_pass(batch)
        self._cached_shape = (profile, base, batch, width, prefill_p, prefill_f, plain_p, by_n,
                              draft_pass)
        return self._cached_shape

    def decide_priced(self, survival: np.ndarray, ceilings: np.ndarray, pr: _Prices) -> Decision:
        """``decide`` for the step ``pr`` prices (``prices``)."""
        if pr.by_n is None:
            self._last_candidates = None
            return self._plain(pr.batch, pr.plain, pr.prefill_s, pr.fixed_k_step or 0)
        # The candidate slots, most likely first, with their requests and
        # positions (a slot that is never accepted is no candidate).
        candidates = _candidates(survival, ceilings)
        self._last_candidates = (survival, ceilings, candidates)
        return self._best(candidates, pr)

    def decide_hoping(self, survival: np.ndarray, ceilings: np.ndarray, due: np.ndarray,
                      hope: np.ndarray, pr: _Prices) -> Decision:
        """``decide_priced`` with the survival rows of the requests ``due`` (a mask
        over the batch) replaced by ``hope``, after ``decide_priced(survival,
        ceilings, pr)``: the candidates are those of that decision, changed."""
        last = self._last_candidates
        if pr.by_n is None or last is None or last[0] is not survival or last[1] is not ceilings:
            hopeful = survival.copy()
            hopeful[due] = hope
            return self.decide_priced(hopeful, ceilings, pr)
        vals, rows, at, _ = last[2]
        return self._best(_with_rows_replaced(vals, rows, at, due, hope, ceilings), pr)

    def _best(self, candidates: tuple, pr: _Prices) -> Decision:
        """The argmax over ``candidates`` (``_candidates``) at the prices ``pr``."""
        batch, fixed_k_step = pr.batch, pr.fixed_k_step
        vals, rows, at, deepest = candidates
        if fixed_k_step is None:
            if not vals.size:
                return self._plain(batch, pr.plain, pr.prefill_s, 0)
            # A K_step past the deepest candidate slot adds a pass for nothing.
            j_first, j_last = 1, deepest + 1
        else:
            j_first = j_last = fixed_k_step
        by_n, ratio = pr.by_n, pr.ratios(vals.size + 1)
        k = np.zeros(batch, dtype=np.int64)
        j, slots, best, seconds, gain = _best_plan(vals, rows, at, by_n, ratio, batch, j_first,
                                                   j_last, pr.draft_pass, pr.owed, k)
        # Without slots: plain decoding, or the pinned K_step's passes alone.
        if fixed_k_step is not None:
            zero_s = max((by_n[0] + (j_first - 1) * pr.draft_pass) * ratio[0], 1e-12)
            zero = float(batch / zero_s)
        else:
            zero_s = pr.plain
            zero = float(batch / pr.plain_charged)
        if best < zero * (1.0 + self.min_gain):
            if fixed_k_step is None:
                return self._plain(batch, pr.plain, pr.prefill_s, 0)
            slots = 0
        if slots == 0:
            return Decision(k_step=j, k=np.zeros(batch, dtype=np.int64),
                            predicted_seconds=float(zero_s + ratio[0] * pr.prefill_p
                                                    + (pr.unseen_s if j > 0 else 0.0)),
                            predicted_tokens=float(batch),
                            plain_seconds=float(pr.plain_full), plain_tokens=float(batch))
        return Decision(k_step=j, k=k,
                        predicted_seconds=float(seconds + ratio[slots] * pr.prefill_p
                                                + pr.unseen_s),
                        predicted_tokens=float(batch + gain),
                        plain_seconds=float(pr.plain_full), plain_tokens=float(batch))

    def price(self, survival: np.ndarray, k: np.ndarray, k_step: int, pr: _Prices) -> Decision:
        """The plan ``k`` (drafts per request) at ``k_step``, priced as ``decide_priced``
        prices the plans it compares: for a plan changed after the argmax (a probe)."""
        batch = pr.batch
        n = int(k.sum())
        if n == 0 or pr.by_n is None:
            return self._plain(batch, pr.plain, pr.prefill_s, k_step)
        ratio = float(pr.ratios(n + 1)[n])
        seconds = max((pr.by_n[n] + (k_step - 1) * pr.draft_pass) * ratio, 1e-12)
        gain = _slots_gain(survival, k)
        return Decision(k_step=k_step, k=k,
                        predicted_seconds=float(seconds + ratio * pr.prefill_p + pr.unseen_s),
                        predicted_tokens=float(batch + gain),
                        plain_seconds=float(pr.plain_full), plain_tokens=float(batch))

    @staticmethod
    def _plain(batch: int, plain: float, prefill_s: float, k_step: int) -> Decision:
        return Decision(k_step=k_step, k=np.zeros(batch, dtype=np.int64),
                        predicted_seconds=plain + prefill_s, predicted_tokens=float(batch),
                        plain_seconds=plain + prefill_s, plain_tokens=float(batch))


class StaticPolicy:
    name = "static"

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, ceilings: np.ndarray, fixed_k_step: int | None = None) -> Decision:
        k_step = fixed_k_step if fixed_k_step is not None else self.k
        # A pinned K_step below K runs fewer draft positions than K.
        k = np.minimum(ceilings, min(self.k, k_step))
        return Decision(k_step=int(k_step), k=k)


class HeuristicPolicy:
    """Per request: +2 after a fully accepted draft, -1 (not below 1) otherwise.

    State is one integer per estimator row, so the controller can update and
    read a whole batch with array operations.
    """

    name = "heuristic"

    def __init__(self, initial_k: int, max_k: int, capacity: int = 64) -> None:
        self.initial_k = initial_k
        self.max_k = max_k
        self._k = np.full(capacity, initial_k, dtype=np.int64)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self._k.size:
            grown = np.full(capacity, self.initial_k, dtype=np.int64)
            grown[: self._k.size] = self._k
            self._k = grown

    def reset(self, row: int) -> None:
        self._k[row] = self.initial_k

    def observe(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        seen = drafted > 0
        rows, drafted, accepted = rows[seen], drafted[seen], accepted[seen]
        k = np.where(accepted >= drafted, self._k[rows] + 2, self._k[rows] - 1)
        self._k[rows] = np.clip(k, 1, max(self.max_k, 1))

    def decide(
        self, rows: np.ndarray, ceilings: np.ndarray, fixed_k_step: int | None = None
    ) -> Decision:
        k = np.minimum(self._k[rows], ceilings)
        if fixed_k_step is None:
            return Decision(k_step=int(k.max(initial=0)), k=k)
        return Decision(k_step=fixed_k_step, k=np.minimum(k, fixed_k_step))
