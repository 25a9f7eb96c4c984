"""The sweep's summary (crossover, regret), a Markdown table, JSON; the sweep
itself is in ``sweep.py``, the plots in ``plots.py``, provenance in
``provenance.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vllm_specplug.tools.sim.analysis import (
    batch_table,
    best_static_by_batch,
    crossover_batch,
    describe,
    typical_context,
)
from vllm_specplug.tools.sim.cost import make_setup
from vllm_specplug.tools.sim.devices import DEVICES
from vllm_specplug.tools.sim.plots import plot
from vllm_specplug.tools.sim.policies import POLICIES, STATIC_KS

BASELINES = ("plain",) + tuple(f"static-{k}" for k in STATIC_KS)
TARGET_RATIO = 0.97

# -- summary ---------------------------------------------------------------------
def aggregate(results: list[dict]) -> dict:
    """Mean goodput over seeds per (setup, scenario, concurrency, policy)."""
    acc: dict = {}
    for r in results:
        key = (r["setup"], r["scenario"], r["concurrency"], r["policy"])
        acc.setdefault(key, []).append(r)
    out: dict = {}
    for (setup, scen, c, pol), rs in acc.items():
        g = [x["goodput"] for x in rs]
        out.setdefault(setup, {}).setdefault(scen, {}).setdefault(c, {})[pol] = {
            "goodput": float(np.mean(g)),
            "goodput_sd": float(np.std(g)),
            "mean_k": float(np.mean([x["mean_k"] for x in rs])),
            "mean_k_step": float(np.mean([x["mean_k_step"] for x in rs])),
            "seeds": len(rs),
        }
    return out


# The plugin's arm, and vLLM's V2 policy it is compared with: vLLM 0.34's
# runner drafts K_step positions (``goodput``); 0.32-0.33's V2 ``draft_model``
# drafts every position, so there the plugin pins K_step (``goodput-pinned``).
V2_ARMS = (("goodput", "v2-av"), ("goodput", "table"), ("goodput-pinned", "v2-av"),
           ("goodput-pinned", "table"))


def summarize(agg: dict) -> dict:
    rows, crossover = [], {}
    for setup, scens in agg.items():
        for scen, by_c in scens.items():
            cs = sorted(by_c)
            for c in cs:
                p = by_c[c]
                if "plain" not in p:
                    continue
                statics = {k: p[f"static-{k}"]["goodput"] for k in STATIC_KS
                           if f"static-{k}" in p}
                best_k = max(statics, key=statics.get) if statics else None
                best_static = statics[best_k] if statics else 0.0
                ref = max(p["plain"]["goodput"], best_static)
                row = {"setup": setup, "scenario": scen, "concurrency": c,
                       "plain": p["plain"]["goodput"], "best_static_k": best_k,
                       "best_static": best_static, "reference": ref}
                for pol in ("table", "v2-av", "heuristic", "goodput", "goodput-pinned",
                            "oracle"):
                    if pol in p:
                        row[pol] = p[pol]["goodput"]
                        row[f"{pol}_vs_ref"] = p[pol]["goodput"] / ref
                # The plugin against vLLM's own V2 policies (V2_ARMS).
                for mine, theirs in V2_ARMS:
                    if mine in p and theirs in p:
                        row[f"{mine}_vs_{theirs}"] = p[mine]["goodput"] / p[theirs]["goodput"]
                if "goodput" in p and "oracle" in p:
                    row["regret"] = 1.0 - p["goodput"]["goodput"] / p["oracle"]["goodput"]
                    row["oracle_vs_ref"] = p["oracle"]["goodput"] / ref
                if "goodput" in p:
                    row["goodput_mean_k"] = p["goodput"]["mean_k"]
                    row["goodput_mean_k_step"] = p["goodput"]["mean_k_step"]
                    row["ok"] = row["goodput_vs_ref"] >= TARGET_RATIO
                rows.append(row)
            for k in STATIC_KS:
                pol = f"static-{k}"
                if not all(pol in by_c[c] and "plain" in by_c[c] for c in cs):
                    continue
                loses = [by_c[c][pol]["goodput"] < by_c[c]["plain"]["goodput"] for c in cs]
                first = None
                for i in range(len(cs)):
                    if all(loses[i:]):
                        first = cs[i]
                        break
                crossover.setdefault(setup, {}).setdefault(scen, {})[k] = first
    return {"rows": rows, "crossover": crossover}


def v2_markdown(agg: dict, rows: list[dict]) -> list[str]:
    """The plugin's goodput over vLLM's V2 policies, per setup and scenario."""
    have = [(m, t) for m, t in V2_ARMS if any(f"{m}_vs_{t}" in r for r in rows)]
    if not have:
        return []
    L = ["## The plugin against vLLM's own V2 policies", "",
         "Goodput ratios, min (at c) / mean over concurrency. `v2-av`: vLLM's adaptive "
         "verification, full-K drafting, verification trimmed with calibrated confidence "
         "against exact cost curves (an upper bound of the feature); `table`: vLLM's "
         "batch-size K table tuned offline with the true acceptance; `goodput`: the plugin "
         "where the drafter drafts K_step positions (vLLM 0.34); `goodput-pinned`: the plugin "
         "with K_step at the ceiling (vLLM 0.32-0.33's V2 `draft_model`).", "",
         "| setup | scenario | " + " | ".join(f"{m} / {t}" for m, t in have) + " |",
         "|---|---|" + "---|" * len(have)]
    for setup in agg:
        for scen in agg[setup]:
            rs = [r for r in rows if r["setup"] == setup and r["scenario"] == scen]
            cells = []
            for m, t in have:
                vals = [(r[f"{m}_vs_{t}"], r["concurrency"]) for r in rs if f"{m}_vs_{t}" in r]
                if not vals:
                    cells.append("-")
                    continue
                lo = min(vals)
                cells.append(f"{lo[0]:.3f} (c={lo[1]}) / {np.mean([v for v, _ in vals]):.3f}")
            L.append(f"| {setup} | {scen} | " + " | ".join(cells) + " |")
    L.append("")
    below = [r for r in rows if r.get("goodput_vs_v2-av", 1.0) < 1.0
             or r.get("goodput_vs_table", 1.0) < 1.0]
    if below:
        L += ["Cells where the plugin (`goodput`) is below `v2-av` or `table`:", "",
              "| setup | scenario | c | goodput / v2-av | goodput / table | mean k | "
              "mean K_step |", "|---|---|---|---|---|---|---|"]
        for r in below:
            L.append(f"| {r['setup']} | {r['scenario']} | {r['concurrency']} | "
                     f"{r.get('goodput_vs_v2-av', float('nan')):.3f} | "
                     f"{r.get('goodput_vs_table', float('nan')):.3f} | "
                     f"{r.get('goodput_mean_k', float('nan')):.2f} | "
                     f"{r.get('goodput_mean_k_step', float('nan')):.2f} |")
        L.append("")
    return L


def analytic_crossover(setup_key: str, gpu: str, draft_at_k0: bool) -> dict:
    s = make_setup(setup_key, gpu=gpu, draft_at_k0=draft_at_k0)
    out = {}
    for name, alpha in (("easy", s.acceptance.easy), ("hard", s.acceptance.hard)):
        out[name] = {k: crossover_batch(s, k, alpha) for k in STATIC_KS}
    return out


PRICES_BATCHES = (1, 16, 32, 64, 128, 256, 512)


def prices_comparison(setups: list[str], gpu: str, draft_at_k0: bool) -> list[dict]:
    """Best static K and its speedup over plain by batch size (decode-only
    steps at L = 1024), on ``gpu``'s prices and, where it has a measured
    table, on the roofline of the same device (``<gpu>-roofline``)."""
    gpus = [gpu] + ([f"{gpu}-roofline"] if DEVICES[gpu].table and f"{gpu}-roofline" in DEVICES
                    else [])
    rows = []
    for key in setups:
        if key.startswith("cpu"):
            continue
        for level in ("easy", "hard"):
            for g in gpus:
                s = make_setup(key, gpu=g, draft_at_k0=draft_at_k0)
                alpha = getattr(s.acceptance, level)
                best = best_static_by_batch(s, alpha, PRICES_BATCHES)
                rows.append({"setup": key, "acceptance": level, "alpha": alpha,
                             "prices": "roofline" if DEVICES[g].table is None else "measured",
                             "gpu": g, "best": {str(b): list(v) for b, v in best.items()}})
    return rows


# -- Markdown ----------------------------------------------------------------------
def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def prices_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    L = ["## Best static K by batch size, measured vs roofline prices", "",
         ("Decode-only steps at L = 1024 (no prefill), homogeneous acceptance; host time "
          "and all-reduces included on both; `K x` = the best static K and its expected "
          "speedup over plain decoding."), "",
         "| setup, acceptance, prices | " + " | ".join(f"B={b}" for b in PRICES_BATCHES) + " |",
         "|---|" + "---|" * len(PRICES_BATCHES)]
    for r in rows:
        cells = [f"{r['best'][str(b)][0]} {r['best'][str(b)][1]:.2f}x" for b in PRICES_BATCHES]
        L.append(f"| {r['setup']} {r['acceptance']} ({r['alpha']}), {r['prices']} | "
                 + " | ".join(cells) + " |")
    return L + [""]


def markdown(meta: dict, setups: dict, agg: dict, summary: dict, tables: dict,
             analytic: dict, calibration: list[dict] | None,
             prices: list[dict] | None = None) -> str:
    L = ["# Simulator results", ""]
    L.append(f"Generated by `{meta['command']}` on {meta['date']} in {meta['runtime_s']:.0f} s "
             f"(controller source sha256 `{meta['controller_sha'][:12]}`, "
             f"git `{meta['git']}`{'; ' + meta['warning'] if meta.get('warning') else ''}). "
             "Goodput = output tokens per simulated second, "
             f"mean of {meta['seeds']} seed(s); each cell measured between request "
             f"completions: after {meta['warmup']} generation(s) of `concurrency` requests, "
             f"over the next {meta['measure']} (at least {meta['min_window']} completions).")
    if meta.get("realism", True):
        L.append("Clock: lognormal noise, 0.5% of steps stalled 5x, the first "
                 f"{meta.get('cold_steps', 2)} steps of each new step shape (drafting or not, "
                 "power-of-two band of scheduled tokens) 3x; the controller's profile "
                 "measurement (and the oracle's engine) warms the shapes it times.")
    else:
        L.append("Clock: lognormal noise only (no cold first steps, no stalls).")
    L.append("")
    L.append("| setup | device | pass prices | TP | target (GB read/pass) | draft (GB read/pass) | "
             "KV/token target | ridge (tokens/pass) | K=0 draft pass | CUDA graphs | "
             "requests in KV |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, d in setups.items():
        L.append(f"| {key} | {d['device']} | {d.get('pricing', 'roofline')} | {d['tp']} | "
                 f"{d['target']} "
                 f"({d['target_weight_gb_read_per_pass']}) | {d['draft']} "
                 f"({d['draft_weight_gb_read_per_pass']}) | {d['target_kv_kib_per_token']} KiB | "
                 f"{d['ridge_tokens']} | {'runs (today)' if d['draft_at_k0'] else 'skipped'} | "
                 f"{d.get('capture_sizes') or 'eager'} | {d['max_concurrency_in_kv']} |")
    L.append("")
    L.append("Requests in KV: how many full-length requests (prompt + output) the KV cache "
             "holds at 90% memory; rows marked † exceed it (vLLM would cap the running batch "
             "there; the simulator does not model preemption).")
    L.append("")
    if calibration:
        L += ["## CPU calibration (cpu-qwen profile vs this machine)", "",
              "| measured point | measured | simulated | error | fitted |", "|---|---|---|---|---|"]
        for r in calibration:
            L.append(f"| {r['point']} | {r['measured']:.3f} | {r['simulated']:.3f} | "
                     f"{100 * r['error']:+.1f}% | "
                     f"{'yes' if r['fitted'] else 'no (out of sample)'} |")
        errs = [abs(r["error"]) for r in calibration]
        fitted = [abs(r["error"]) for r in calibration if r["fitted"]]
        L += ["", f"Median absolute error {100 * float(np.median(errs)):.1f}%, "
              f"max {100 * max(errs):.1f}% (fitted points: median "
              f"{100 * float(np.median(fitted)):.1f}%). The adaptive rows were measured with "
              "the controller of that time and are simulated with this one (see "
              "`vllm_specplug/tools/sim/calibration.py`).", ""]
    rows = summary["rows"]
    L += ["## Summary: goodput policy against the best fixed choice and the oracle", "",
          "`goodput / ref`: goodput policy over max(plain, best static K) of the same cell "
          f"(target >= {TARGET_RATIO}); regret: 1 - goodput / oracle.", "",
          "| setup | scenario | min goodput/ref (at c) | cells < 0.97 | mean regret | "
          "max regret (at c) |", "|---|---|---|---|---|---|"]
    for setup in agg:
        for scen in agg[setup]:
            rs = [r for r in rows if r["setup"] == setup and r["scenario"] == scen
                  and "goodput_vs_ref" in r]
            if not rs:
                continue
            worst = min(rs, key=lambda r: r["goodput_vs_ref"])
            bad = sum(1 for r in rs if not r["ok"])
            reg = [r for r in rs if "regret" in r]
            regs = " | -" * 2
            if reg:
                mx = max(reg, key=lambda r: r["regret"])
                regs = (f" | {100 * np.mean([r['regret'] for r in reg]):.1f}% | "
                        f"{100 * mx['regret']:.1f}% (c={mx['concurrency']})")
            L.append(f"| {setup} | {scen} | {worst['goodput_vs_ref']:.3f} "
                     f"(c={worst['concurrency']}) | {bad}/{len(rs)}{regs} |")
    L.append("")
    L += v2_markdown(agg, rows)
    L += prices_markdown(prices or [])
    for setup in agg:
        d = setups[setup]
        L += [f"## {setup}: {d['label']}", ""]
        L.append(f"vLLM batch table used by `table` (`num_speculative_tokens_per_batch_size`, "
                 f"tuned offline on the mixed population): `{json.dumps(tables[setup])}`")
        L.append("")
        an = analytic.get(setup)
        if an:
            L.append("Crossover, analytic (decode-only steps, typical context): first batch size "
                     "where static K loses to plain: " + "; ".join(
                         f"{name} (alpha {d['acceptance'][name]}): " + ", ".join(
                             f"K={k} {v if v is not None else '> 4096'}"
                             for k, v in an[name].items())
                         for name in ("easy", "hard")) + ".")
            L.append("")
        for scen in agg[setup]:
            by_c = agg[setup][scen]
            cross = summary["crossover"].get(setup, {}).get(scen, {})
            L.append(f"### {setup} / {scen}")
            L.append("")
            pols = [p for p in POLICIES if any(p in by_c[c] for c in by_c)]
            head = ["c", "plain tok/s"] + [p for p in pols if p != "plain"] + \
                ["goodput/ref", "regret"]
            L.append("| " + " | ".join(head) + " |")
            L.append("|" + "---|" * len(head))
            for c in sorted(by_c):
                p = by_c[c]
                plain = p.get("plain", {}).get("goodput")
                over = c > d["max_concurrency_in_kv"]
                cells = [f"{c}{' †' if over else ''}", _f(plain, 0)]
                for pol in pols:
                    if pol == "plain":
                        continue
                    g = p.get(pol, {}).get("goodput")
                    cells.append("-" if g is None or not plain else f"{g / plain:.2f}x")
                r = next((r for r in rows if r["setup"] == setup and r["scenario"] == scen
                          and r["concurrency"] == c), {})
                gv = r.get("goodput_vs_ref")
                cells.append("-" if gv is None else (f"**{gv:.3f}**" if gv < TARGET_RATIO
                                                     else f"{gv:.3f}"))
                cells.append("-" if "regret" not in r else f"{100 * r['regret']:.1f}%")
                L.append("| " + " | ".join(cells) + " |")
            if cross:
                L.append("")
                L.append("Crossover (simulated; first c from which static K stays below plain): "
                         + ", ".join(f"K={k}: {v if v is not None else 'never'}"
                                     for k, v in cross.items()) + ".")
            L.append("")
    return "\n".join(L) + "\n"



def write_outputs(out: Path, meta: dict, specs_opts: dict, results: list[dict],
                  setups: list[str], calibration: list[dict] | None,
                  plots: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    gpu = specs_opts.get("gpu", "h200")
    dk0 = specs_opts.get("draft_at_k0", True)
    setup_objs = {k: make_setup(k, gpu=gpu, draft_at_k0=dk0, tp=specs_opts.get("tp"))
                  for k in setups}
    described = {k: describe(s) for k, s in setup_objs.items()}
    tables = {k: batch_table(s, typical_context(s), [s.max_concurrency])
              for k, s in setup_objs.items()}
    agg = aggregate(results)
    summary = summarize(agg)
    analytic = {k: analytic_crossover(k, gpu, dk0) for k in setups}
    prices = prices_comparison(setups, gpu, dk0) if specs_opts.get("tp") is None else []
    files = plot(agg, described, out) if plots else []
    md = markdown(meta, described, agg, summary, tables, analytic, calibration, prices)
    (out / "results.md").write_text(md)
    doc = {"meta": meta, "setups": described, "batch_tables": tables,
           "analytic_crossover": analytic, "prices_comparison": prices,
           "calibration": calibration,
           "summary": summary, "aggregate": {s: {sc: {str(c): v for c, v in bc.items()}
                                                  for sc, bc in d.items()}
                                              for s, d in agg.items()},
           "cells": results, "plots": files}
    (out / "results.json").write_text(json.dumps(doc, separators=(",", ":"),
                                                 default=_jsonable) + "\n")
    return doc


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)
