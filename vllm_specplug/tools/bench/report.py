"""Benchmark results: per-cell medians, ratios, target checks, table, plots.

``results.json`` schema:

    meta:  command, date, wall_minutes, machine, vllm, setups {name: title},
           concurrency [..], repeats
    runs:  one object per timed run: setup, workload, concurrency, policy,
           rep, tok_s, wall_s, output_tokens, tpot_mean_s, tpot_p90_s,
           accepted_len (tokens per verify step incl. the bonus token),
           drafted_per_step (drafts per request-step), fallback_frac
           (request-steps without drafts), engine_steps
    cells: one object per (setup, workload, concurrency, policy): the
           medians of the runs' fields, tok_s_min / tok_s_max (spread), n,
           x_plain (median tok/s over plain decoding's: the "k0" runs, plain
           decoding interleaved on the speculative engine, or the plain
           engine's when there are none), x_best_static (over the cell's
           best static K), x_best_fixed (over max(plain, best static))
    best_static: {"setup/workload/c": "static-K<k>"}
    targets: [{target, setup, workload, concurrency, value, needed, ok}]
    mismatches: [{setup, workload, concurrency, policy, rep, requests,
                  also_under_static_k}]  (true: a static K's own, or every request
                  also diverged under a static K there; see bench.__main__)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

EASY = ("code_completion", "code_edit", "easy")
FIELDS = ("tok_s", "tpot_mean_s", "tpot_p90_s", "accepted_len", "drafted_per_step",
          "fallback_frac", "engine_steps")


def _median(xs):
    xs = [x for x in xs if x == x]  # drop NaN
    return statistics.median(xs) if xs else float("nan")


def summarise(runs, meta: dict, mismatches: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in runs:
        groups[(r.setup, r.workload, r.concurrency, r.policy)].append(r)
    cells = {}
    for key, rs in groups.items():
        cell = dict(zip(("setup", "workload", "concurrency", "policy"), key))
        for f in FIELDS:
            cell[f] = _median([getattr(r, f) for r in rs])
        cell["tok_s_min"] = min(r.tok_s for r in rs)
        cell["tok_s_max"] = max(r.tok_s for r in rs)
        cell["n"] = len(rs)
        cells[key] = cell
    best_static = {}
    for (s, w, c, p), cell in cells.items():
        # The baseline: plain decoding interleaved on the speculative engine
        # ("k0"), else the plain engine.
        plain = cells.get((s, w, c, "k0")) or cells.get((s, w, c, "plain"))
        statics = {q: x for (s2, w2, c2, q), x in cells.items()
                   if (s2, w2, c2) == (s, w, c) and q.startswith("static-K")}
        best = max(statics, key=lambda q: statics[q]["tok_s"]) if statics else None
        if best:
            best_static[f"{s}/{w}/{c}"] = best
        base_plain = plain["tok_s"] if plain else float("nan")
        base_static = statics[best]["tok_s"] if best else float("nan")
        fixed = max([x for x in (base_plain, base_static) if x == x], default=float("nan"))
        cell["x_plain"] = cell["tok_s"] / base_plain if base_plain == base_plain else None
        cell["x_best_static"] = cell["tok_s"] / base_static if base_static == base_static else None
        cell["x_best_fixed"] = cell["tok_s"] / fixed if fixed == fixed else None
    results = dict(meta=meta, runs=[r.summary() for r in runs],
                   cells=list(cells.values()), best_static=best_static,
                   mismatches=mismatches)
    results["targets"] = check_targets(results)
    return results


def check_targets(results: dict) -> list[dict]:
    """The benchmark issue's targets, for the goodput policy, cell by cell."""
    cells = {(c["setup"], c["workload"], c["concurrency"], c["policy"]): c
             for c in results["cells"]}
    out = []
    for (s, w, c, p), cell in sorted(cells.items()):
        if p != "goodput":
            continue
        if cell["x_best_fixed"] is not None:
            out.append(dict(target=">= 0.95 x max(plain, best static K)", setup=s, workload=w,
                            concurrency=c, value=round(cell["x_best_fixed"], 3), needed=0.95,
                            ok=cell["x_best_fixed"] >= 0.95))
    mixed = defaultdict(list)
    for (s, w, c, p), cell in cells.items():
        if w == "mixed" and p == "goodput":
            globals_ = [x["tok_s"] for (s2, w2, c2, q), x in cells.items()
                        if (s2, w2, c2) == (s, w, c) and (q.startswith("static-K")
                                                          or q == "vllm-table")]
            if globals_:
                mixed[s].append((c, cell["tok_s"] / max(globals_)))
    for s, pairs in mixed.items():
        best = max(r for _, r in pairs)
        worst = min(r for _, r in pairs)
        out.append(dict(target="mixed: beats every global setting by >= 10% at some load",
                        setup=s, workload="mixed", concurrency=None, value=round(best, 3),
                        needed=1.10, ok=best >= 1.10))
        out.append(dict(target="mixed: never below every global setting by > 5%",
                        setup=s, workload="mixed", concurrency=None, value=round(worst, 3),
                        needed=0.95, ok=worst >= 0.95))
    return out


def markdown(results: dict) -> str:
    cells = results["cells"]
    lines = []
    setups = sorted({c["setup"] for c in cells})
    for s in setups:
        mine = [c for c in cells if c["setup"] == s]
        policies = sorted({c["policy"] for c in mine}, key=_policy_order)
        title = results["meta"].get("setups", {}).get(s, s)
        lines.append(f"\n### {title}\n")
        lines.append("Output tokens/s as a multiple of plain decoding (median of the "
                     "interleaved runs; the baseline's tok/s in its column). `k0` is plain "
                     "decoding run interleaved on the speculative engine (every K is 0, the "
                     "draft never runs) and is the baseline; `plain` is a separate engine "
                     "without speculation, run before/after the others.\n")
        head = ["workload", "c"] + policies + ["best static", "goodput / max(plain, best static)"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        keys = sorted({(c["workload"], c["concurrency"]) for c in mine})
        by = {(c["workload"], c["concurrency"], c["policy"]): c for c in mine}
        for w, conc in keys:
            row = [w, str(conc)]
            for p in policies:
                cell = by.get((w, conc, p))
                if cell is None:
                    row.append("")
                elif p == ("k0" if any(q == "k0" for q in policies) else "plain"):
                    row.append(f"{cell['tok_s']:.2f} tok/s")
                elif cell["x_plain"] is not None:
                    row.append(f"{cell['x_plain']:.2f}x")
                else:
                    row.append(f"{cell['tok_s']:.2f} tok/s")
            row.append(results["best_static"].get(f"{s}/{w}/{conc}", "-"))
            g = by.get((w, conc, "goodput"))
            row.append(f"{g['x_best_fixed']:.2f}" if g and g["x_best_fixed"] is not None else "-")
            lines.append("| " + " | ".join(row) + " |")
        detail = [c for c in mine if c["policy"] in ("goodput", "goodput-no-zcf", "heuristic")]
        if detail:
            lines.append("\n| workload | c | policy | accepted length | drafts/step | "
                         "fallback steps | TPOT mean / p90 (s) | tok/s spread |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for c in sorted(detail, key=lambda c: (c["workload"], c["concurrency"],
                                                   _policy_order(c["policy"]))):
                lines.append(
                    f"| {c['workload']} | {c['concurrency']} | {c['policy']} | "
                    f"{c['accepted_len']:.2f} | {c['drafted_per_step']:.2f} | "
                    f"{100 * c['fallback_frac']:.0f}% | {c['tpot_mean_s']:.3f} / "
                    f"{c['tpot_p90_s']:.3f} | {c['tok_s_min']:.2f}-{c['tok_s_max']:.2f} |")
    misses = [t for t in results["targets"] if not t["ok"]]
    lines.append(f"\nTargets: {len(results['targets']) - len(misses)} of "
                 f"{len(results['targets'])} met.")
    for t in misses:
        where = f"{t['setup']} {t['workload']}" + (
            f" c={t['concurrency']}" if t["concurrency"] is not None else "")
        lines.append(f"- MISSED: {t['target']}: {where}: {t['value']} (needed {t['needed']})")
    if not any(c["policy"] == "plain" for c in results["cells"]):
        lines.append("\nNo plain-engine run in this benchmark: outputs were not compared with "
                     "plain decoding.")
    elif results["mismatches"]:
        shared = sum(bool(m.get("also_under_static_k")) for m in results["mismatches"])
        lines.append(f"\n**{len(results['mismatches'])} greedy-output mismatches against plain "
                     f"decoding** (see results.json); {shared} of them a static K's own or on "
                     "requests that a static K also got wrong in the same cell and repeat "
                     "(verification numerics, which the plugin does not change).")
    else:
        lines.append("\nGreedy outputs of every policy equal plain decoding in every run.")
    return "\n".join(lines) + "\n"


def _policy_order(p: str):
    order = ["k0", "plain", "static-K1", "static-K2", "static-K4", "static-K8", "vllm-table",
             "heuristic", "goodput-no-zcf", "goodput"]
    return (order.index(p) if p in order else len(order), p)


def write(results: dict, out: Path, traces: dict[str, str]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(
        f"Command: `{results['meta']['command']}`  \nMachine: {results['meta']['machine']}, "
        f"vLLM {results['meta']['vllm']}, {results['meta']['date']}, "
        f"{results['meta']['wall_minutes']} min\n" + markdown(results))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plots")
        return
    cells = results["cells"]
    for s in sorted({c["setup"] for c in cells}):
        mine = [c for c in cells if c["setup"] == s and c["x_plain"] is not None]
        workloads = sorted({c["workload"] for c in mine})
        policies = sorted({c["policy"] for c in mine}, key=_policy_order)
        loads = sorted({c["concurrency"] for c in mine})
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8),
                                 squeeze=False, sharey=True)
        for ax, w in zip(axes[0], workloads):
            for i, p in enumerate(policies):
                pts = sorted((c["concurrency"], c["x_plain"]) for c in mine
                             if c["workload"] == w and c["policy"] == p)
                style = dict(lw=2.5, color="black") if p == "goodput" else dict(lw=1.2)
                if len(loads) == 1:
                    ax.bar(i, pts[0][1] if pts else 0, label=p,
                           color="black" if p == "goodput" else None)
                else:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p,
                            **style)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(w)
            if len(loads) == 1:
                ax.set_xticks([])
                ax.set_xlabel(f"concurrency {loads[0]}")
            else:
                ax.set_xscale("log", base=2)
                ax.set_xlabel("concurrency")
        axes[0][0].set_ylabel("throughput / plain decoding")
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(results["meta"].get("setups", {}).get(s, s))
        fig.tight_layout()
        fig.savefig(out / f"speedup-{s}.png", dpi=110)
        plt.close(fig)
    for s, path in traces.items():
        if Path(path).exists():
            from vllm_specplug.tools.trace_report import plot_k_over_time, read_trace

            plot_k_over_time(read_trace(path), str(out / f"k-over-time-{s}-mixed.png"))
