"""Analysis over the cost model: survival curves, vLLM's batch-size table
tuned offline, the crossover batch, the best static K by batch size, and a
setup's description.

Nothing here imports vLLM or the controller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm_specplug.tools.sim.cost import Setup


def survival_curve(alpha: float, decay: float, width: int) -> np.ndarray:
    cond = alpha * decay ** np.arange(width)
    return np.cumprod(np.clip(cond, 0.0, 1.0))


def batch_table(setup: Setup, ctx: float, batches: list[int]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` tuned offline for
    ``setup``: for each batch-size bucket [2^i, 2^(i+1) - 1] the K that
    maximises expected goodput at the bucket's lower edge, for the *mixed*
    population (half easy, half hard requests).  This is what vLLM's own
    profiling helper would produce from a representative workload: a strong,
    static baseline."""
    cost = setup.cost()
    acc = setup.acceptance
    s_easy = survival_curve(acc.easy, acc.decay, setup.max_k)
    s_hard = survival_curve(acc.hard, acc.decay, setup.max_k)
    surv = 0.5 * (s_easy + s_hard)
    table = []
    lo = 1
    top = max(batches)
    while lo <= top:
        hi = 2 * lo - 1
        best = max(range(setup.max_k + 1), key=lambda k: (
            cost.expected_goodput(lo, k, ctx, surv), -k))
        table.append([lo, hi, best])  # above the last range vLLM keeps its K
        lo *= 2
    return table


def table_lookup(table: list[list[int]], batch: int, max_k: int) -> int:
    """vLLM's semantics: ranges [lo, hi, K]; a gap takes the previous K,
    batches above the last range take the last K; K is capped at max_k."""
    k = table[0][2]
    for lo, hi, kk in table:
        if batch < lo:
            break
        k = kk
        if batch <= hi:
            break
    return min(k, max_k)


def typical_context(setup: Setup) -> float:
    w = setup.workload
    return float(w.prompt_median + 0.5 * w.output_median)


def crossover_batch(setup: Setup, k: int, alpha: float, ctx: float | None = None,
                    limit: int = 4096) -> int | None:
    """Smallest batch from which static K=k has lower expected goodput than
    plain decoding (decode-only steps, homogeneous acceptance ``alpha``), or
    None if it still wins at ``limit``."""
    cost = setup.cost()
    ctx = typical_context(setup) if ctx is None else ctx
    surv = survival_curve(alpha, setup.acceptance.decay, setup.max_k)
    b = 1
    while b <= limit:
        if cost.expected_goodput(b, k, ctx, surv) < cost.expected_goodput(b, 0, ctx, surv):
            # refine between b/2 and b
            lo = max(b // 2, 1)
            for bb in range(lo, b + 1):
                spec = cost.expected_goodput(bb, k, ctx, surv)
                if spec < cost.expected_goodput(bb, 0, ctx, surv):
                    return bb
            return b
        b *= 2
    return None


def best_static_by_batch(setup: Setup, alpha: float, batches, ctx: float = 1024.0,
                         max_k: int | None = None) -> dict[int, tuple[int, float]]:
    """Per batch size: the best static K and its expected speedup over plain
    decoding (decode-only steps at context ``ctx``, homogeneous acceptance
    ``alpha``), host time included."""
    cost = setup.cost()
    surv = survival_curve(alpha, setup.acceptance.decay, setup.max_k)
    out = {}
    for b in batches:
        plain = cost.expected_goodput(b, 0, ctx, surv)
        best = max(range(1 + (max_k or setup.max_k)),
                   key=lambda k: (cost.expected_goodput(b, k, ctx, surv), -k))
        out[b] = (best, cost.expected_goodput(b, best, ctx, surv) / plain)
    return out


def describe(setup: Setup) -> dict:
    t, q, d = setup.target, setup.draft, setup.device
    return {
        "key": setup.key,
        "label": setup.label,
        "device": d.name,
        "device_source": d.source,
        "tp": setup.tp,
        "target": t.name,
        "target_params_b": round(t.params / 1e9, 3),
        "target_weight_gb_read_per_pass": round(t.weight_bytes / 1e9, 3),
        "target_kv_kib_per_token": round(t.kv_bytes_per_token / 1024, 2),
        "draft": q.name,
        "draft_params_b": round(q.params / 1e9, 3),
        "draft_weight_gb_read_per_pass": round(q.weight_bytes / 1e9, 3),
        "method": setup.method,
        "draft_at_k0": setup.draft_at_k0,
        "acceptance": {"easy": setup.acceptance.easy, "hard": setup.acceptance.hard,
                       "decay": setup.acceptance.decay},
        "max_k": setup.max_k,
        "noise_sigma": setup.noise,
        "capture_sizes": (None if setup.capture_sizes() is None
                          else f"{len(setup.capture_sizes())} sizes up to "
                               f"{setup.capture_sizes()[-1]}"),
        "kv_capacity_tokens": int(setup.kv_capacity_tokens()),
        "max_concurrency_in_kv": int(setup.kv_capacity_tokens()
                                     // (setup.workload.prompt_median
                                         + setup.workload.output_median)),
        "draft_size_ratio": round(setup.draft_size_ratio(), 4),
        "pricing": (f"measured passes (data/{d.table})" if d.table else "roofline"),
        "ridge_tokens": "-" if d.table else round(_ridge_tokens(setup), 1),
        "host_step_ms": round(d.step_overhead_s * 1e3, 3),
        "host_draft_pass_ms": round(d.pass_overhead_s * 1e3, 3),
        "allreduce": (None if setup.tp <= 1 else
                      f"2 per layer, {d.allreduce_s * 1e6:g} us + bytes at "
                      f"{d.allreduce_bytes_per_s / 1e9:g} GB/s (assumed)"),
    }


def _ridge_tokens(setup: Setup) -> float:
    """Tokens per pass at which the target's weight GEMMs turn compute-bound."""
    c = setup.cost()
    t = setup.target
    return (t.weight_bytes / c.bw) / (t.flops_per_token / c.fl)
