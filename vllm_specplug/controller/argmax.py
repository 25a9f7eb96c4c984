"""The goodput policy's argmax kernels (numba): the candidate slots of a plan,
most likely first, and the best plan over them at one step's prices.

``GoodputPolicy`` (``policy.py``) calls them; they know survivals, ceilings
and price arrays, nothing else.
"""

import math

import numba
import numpy as np


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

    ``ratio[j, n]``: the correction of a plan of K_step j and n slots.  Plans
    are visited K_step by K_step, each along the sorted slots, and the
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
            seconds = max((by_n[n] + passes) * ratio[j, n], 1e-12)
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
