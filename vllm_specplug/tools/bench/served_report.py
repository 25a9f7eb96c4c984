"""Tables, plots and the greedy comparison of the served benchmark.

``results.json`` holds ``meta``, ``servers`` (per arm: ready time, KV-cache
capacity in tokens as vLLM reports it, resident memory), ``runs`` (one per
arm and cell, vLLM's client's metrics without the texts), ``cells`` (warm
cells: each arm's output tokens/s as a multiple of plain's and the adaptive
arm's ratio to the best of plain and the static arms), ``cold``, ``noise``
(the first cell run again last on each arm's server), ``misses``,
``failures`` (runs or server starts that failed; the grid goes on without
them) and ``mismatches`` (greedy texts that differ from plain decoding's).
With several rounds (``--rounds``) a cell pools its rounds: output tokens
over summed duration, percentiles over every request of every round,
acceptance over the summed counters; ``cells[...]["rounds"]`` keeps each
round's ratio of the adaptive arm to the cell's best fixed arm (chosen on
the pooled throughput), ``cells[...]["interval"]`` a 90% confidence
interval of that ratio from the rounds' spread, and texts are compared
round by round.  Rounds of separate runs of one grid pool the same way
(``python -m vllm_specplug.tools.bench --served --pool DIR DIR ... --out DIR``).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

TARGET = 0.95
# Two-sided 90% quantiles of Student's t by degrees of freedom (1..10; the
# normal's past that is close enough for a report).
_T90 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)
STATIC = ("vllm-k2", "vllm-k4", "vllm-k6", "vllm-k8", "vllm-table")
# The plugin's adaptive policy without and with the draft's confidence (the
# default): neither is a fixed arm the adaptive one is judged against.
ADAPTIVE = ("adaptive-history", "adaptive")
ORDER = ("plain", "vllm-k2", "vllm-k4", "vllm-k6", "vllm-k8", "vllm-table", "plugin-k2",
         "plugin-k0", *ADAPTIVE)


def _load(r) -> str:
    return f"rate {r['rate']}/s" if r["kind"] == "rate" else f"c={r['concurrency']}"


def _by(runs, kind):
    out = {}
    for r in runs:
        if r["kind"] == kind:
            out[(r["setup"], r["workload"], _load(r), r["arm"])] = r
    return out


def spec_rates(d: dict) -> dict:
    """Acceptance figures from vLLM's spec-decode counters (``drafts``, ``draft_tokens``, ``accepted``)."""
    return dict(acceptance=(d["accepted"] / d["draft_tokens"]) if d["draft_tokens"] else None,
                drafts_per_draft_step=(d["draft_tokens"] / d["drafts"]) if d["drafts"] else 0.0,
                accepted_len=(1 + d["accepted"] / d["drafts"]) if d["drafts"] else None)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _pool(group: list[dict]) -> dict:
    """One arm's one cell over its rounds: a longer run of the same prompts."""
    if len(group) == 1:
        return group[0]
    out = dict(group[0], round=None)
    dur = sum(r.get("duration") or 0.0 for r in group)
    toks = sum(r.get("total_output_tokens") or 0 for r in group)
    out["output_throughput"] = (toks / dur if dur and toks else
                                statistics.fmean(r["output_throughput"] for r in group))
    for k in ("completed", "failed", "total_output_tokens", "duration"):
        if all(k in r for r in group):
            out[k] = sum(r[k] for r in group)
    out["requests"] = sum(r["requests"] for r in group)
    for name, key in (("tpot", "tpots_ms"), ("ttft", "ttfts_ms")):
        xs = [x for r in group for x in r.get(key) or []]
        if xs:
            out[key] = xs
            out.update({f"mean_{name}_ms": statistics.fmean(xs), f"p50_{name}_ms": _pct(xs, 0.5),
                        f"p99_{name}_ms": _pct(xs, 0.99)})
    counts = [r.get("spec_counts") for r in group]
    if all(counts):
        d = {k: sum(c[k] for c in counts) for k in counts[0]}
        out.update(spec_counts=d, **spec_rates(d))
    out["texts"] = [t for r in group for t in r.get("texts") or []]
    return out


def _pooled(runs) -> list[dict]:
    groups: dict = {}
    for r in runs:
        key = (r["setup"], r["arm"], r["workload"], r["kind"], r["concurrency"])
        groups.setdefault(key, []).append(r)
    return [_pool(g) for g in groups.values()]


def _vs_best(tok_s: dict) -> tuple[str, float] | None:
    """(best fixed arm, adaptive / its tok/s) for one cell's arms, or None."""
    fixed = {a: v for a, v in tok_s.items() if a not in ADAPTIVE}
    if "adaptive" not in tok_s or not fixed:
        return None
    best = max(fixed, key=fixed.get)
    return best, tok_s["adaptive"] / fixed[best]


def _round_ratios(runs, best: dict) -> dict:
    """Per (setup, workload, load): adaptive / ``best[cell]`` (an arm), round by round.

    The arm is the cell's best on the pooled throughput, the same in every
    round: the best of several arms picked afresh each round would be the
    luckiest of them, a baseline biased upwards by the noise.
    """
    rounds: dict = {}
    for r in runs:
        if r["kind"] in ("c", "rate") and r.get("round"):
            rounds.setdefault((r["setup"], r["workload"], _load(r), r["round"]), {})[
                r["arm"]] = r["output_throughput"]
    out: dict = {}
    for (s, w, load, rnd), arms in sorted(rounds.items()):
        arm = best.get((s, w, load))
        if arm in arms and "adaptive" in arms and arms[arm]:
            out.setdefault((s, w, load), []).append(arms["adaptive"] / arms[arm])
    return out


def ratio_interval(ratios: list[float]) -> tuple[float, float] | None:
    """A 90% confidence interval of a ratio from its rounds (Student's t on log ratios).

    Rounds are the replications: each has its own servers and its own share
    of the machine's slow and fast spells, so their spread is the
    benchmark's noise.  None with fewer than two rounds.
    """
    logs = [math.log(x) for x in ratios if x and x > 0]
    n = len(logs)
    if n < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = (_T90[n - 2] if n - 1 <= len(_T90) else 1.645) * sd / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)


def _mismatches(runs) -> list[dict]:
    plain = {(r["setup"], r["workload"], _load(r), r["kind"], r.get("round")): r
             for r in runs if r["arm"] == "plain"}
    found = {}
    for r in runs:
        base = plain.get((r["setup"], r["workload"], _load(r), r["kind"], r.get("round")))
        if r["arm"] == "plain" or base is None:
            continue
        diff = [i for i, (a, b) in enumerate(zip(r["texts"], base["texts"])) if a != b]
        diff += list(range(min(len(r["texts"]), len(base["texts"])),
                           max(len(r["texts"]), len(base["texts"]))))
        if diff:
            key = (r["setup"], r["workload"], _load(r), r["kind"], r["arm"])
            found[key] = sorted(set(found.get(key, [])) | set(diff))
    out = []
    for (s, w, load, kind, arm), diff in found.items():
        statics = set()
        for a in STATIC:
            statics.update(found.get((s, w, load, kind, a), []))
        explained = arm in STATIC or set(diff) <= statics
        out.append(dict(setup=s, workload=w, load=load, kind=kind, arm=arm, requests=diff,
                        explained=explained))
    return out


def summarise(runs: list[dict], servers: list[dict], meta: dict,
              failures: list[dict] | None = None) -> dict:
    by_round, runs = runs, _pooled(runs)
    warm, cold, rep = _by(runs, "c"), _by(runs, "cold"), _by(runs, "repeat")
    warm.update(_by(runs, "rate"))
    cells = []
    for (s, w, load) in sorted({k[:3] for k in warm}, key=lambda k: (k[0], k[1], k[2])):
        arms = {a: warm[(s, w, load, a)] for a in ORDER if (s, w, load, a) in warm}
        plain = arms.get("plain", {}).get("output_throughput")
        cell = dict(setup=s, workload=w, load=load, plain_tok_s=plain,
                    x_plain={a: (r["output_throughput"] / plain if plain else None)
                             for a, r in arms.items()})
        vs = _vs_best({a: r["output_throughput"] for a, r in arms.items()})
        if vs:
            cell.update(best_fixed=vs[0], adaptive_vs_best=vs[1])
        cells.append(cell)
    multi = len({r.get("round") for r in by_round}) > 1
    if multi:
        per_round = _round_ratios(by_round, {(c["setup"], c["workload"], c["load"]):
                                             c["best_fixed"] for c in cells if "best_fixed" in c})
        for c in cells:
            ratios = per_round.get((c["setup"], c["workload"], c["load"]))
            if ratios:
                c.update(rounds=ratios, interval=ratio_interval(ratios))
    cold_rows = []
    for (s, w, load, a), r in sorted(cold.items()):
        warm_r = warm.get((s, w, load, a))
        cold_rows.append(dict(setup=s, workload=w, load=load, arm=a,
                              cold_tok_s=r["output_throughput"],
                              warm_tok_s=warm_r["output_throughput"] if warm_r else None,
                              cold_ttft_ms=r.get("mean_ttft_ms"),
                              warm_ttft_ms=warm_r.get("mean_ttft_ms") if warm_r else None))
    noise = []
    for (s, w, load, a), r in sorted(rep.items()):
        first = warm.get((s, w, load, a))
        if first:
            x, y = first["output_throughput"], r["output_throughput"]
            noise.append(dict(setup=s, workload=w, load=load, arm=a, first_tok_s=x,
                              repeat_tok_s=y, spread=abs(x - y) / max((x + y) / 2, 1e-9)))
    misses = [dict(setup=c["setup"], workload=c["workload"], load=c["load"],
                   ratio=c["adaptive_vs_best"], best=c["best_fixed"])
              for c in cells if c.get("adaptive_vs_best") is not None
              and c["adaptive_vs_best"] < TARGET]
    def slim(rs):
        return [{k: v for k, v in r.items() if k not in ("texts", "tpots_ms", "ttfts_ms")}
                for r in rs]

    extra = dict(runs_by_round=slim(by_round)) if multi else {}
    return dict(meta=meta, servers=servers, runs=slim(runs), **extra, cells=cells,
                cold=cold_rows, noise=noise,
                misses=misses, failures=failures or [], mismatches=_mismatches(by_round),
                tpots={f"{r['setup']}|{r['workload']}|{_load(r)}|{r['arm']}": r["tpots_ms"]
                       for r in runs if r["kind"] in ("c", "rate")})


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = []
    for s, title in m["setups"].items():
        cells = [c for c in res["cells"] if c["setup"] == s]
        arms = [a for a in ORDER if any(a in c["x_plain"] for c in cells)]
        rounds = m.get("rounds", 1)
        pooled = (f" Each cell pools {rounds} rounds (a fresh server per arm and round, the arm "
                  "order reversed every other round): output tokens over summed duration. The "
                  "last columns are adaptive / the cell's best fixed arm (on the pooled "
                  "throughput) in each round, and a 90% confidence interval of that ratio from "
                  "the rounds' spread (Student's t on log ratios): where it holds 0.95, the "
                  "rounds cannot tell a met cell from a missed one." if rounds > 1 else "")
        lines += [f"### {title}", "",
                  f"Served with `vllm-specplug serve`, measured with `vllm bench serve` (temperature 0, "
                  f"{m['output_tokens'][s]} output tokens per request, dtype {m['dtype'][s]}). "
                  "Output tokens/s as a multiple of plain decoding's (its tok/s in its column); "
                  "warm cells (after the server's cold run)." + pooled, "",
                  "| workload | load | plain | " + " | ".join(a for a in arms if a != "plain")
                  + " | best fixed | adaptive / best |"
                  + (" per round | 90% interval |" if rounds > 1 else ""),
                  "|---|---|---|" + "---|" * (len(arms) - 1) + "---|---|"
                  + ("---|---|" if rounds > 1 else "")]
        for c in cells:
            row = [c["workload"], c["load"], _f(c["plain_tok_s"], "{:.2f} tok/s")]
            row += [_f(c["x_plain"].get(a), "{:.2f}x") for a in arms if a != "plain"]
            row += [c.get("best_fixed", "-"), _f(c.get("adaptive_vs_best"))]
            if rounds > 1:
                row.append(", ".join(_f(x) for x in c.get("rounds", [])) or "-")
                iv = c.get("interval")
                row.append(f"{iv[0]:.2f}-{iv[1]:.2f}" if iv else "-")
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "| workload | load | arm | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) "
                  "| acceptance | tokens per draft step |", "|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in res["runs"] if r["setup"] == s and r["kind"] in ("c", "rate")),
                        key=lambda r: (r["workload"], _load(r), ORDER.index(r["arm"]))):
            lines.append(
                f"| {r['workload']} | {_load(r)} | {r['arm']} | "
                f"{_f(r.get('mean_ttft_ms'), '{:.0f}')} / {_f(r.get('p50_ttft_ms'), '{:.0f}')} / "
                f"{_f(r.get('p99_ttft_ms'), '{:.0f}')} | {_f(r.get('mean_tpot_ms'), '{:.0f}')} / "
                f"{_f(r.get('p50_tpot_ms'), '{:.0f}')} / {_f(r.get('p99_tpot_ms'), '{:.0f}')} | "
                f"{_f(r.get('acceptance'))} | {_f(r.get('accepted_len'))} |")
        cold = [c for c in res["cold"] if c["setup"] == s]
        if cold:
            lines += ["", "Cold (the first requests after the server is ready) and warm, same load "
                      "and workload, other prompts:", "",
                      "| arm | workload | load | cold tok/s | warm tok/s | cold / warm | "
                      "cold TTFT (ms) | warm TTFT (ms) |", "|---|---|---|---|---|---|---|---|"]
            for c in sorted(cold, key=lambda c: ORDER.index(c["arm"])):
                ratio = (c["cold_tok_s"] / c["warm_tok_s"]) if c["warm_tok_s"] else None
                lines.append(f"| {c['arm']} | {c['workload']} | {c['load']} | {_f(c['cold_tok_s'])} "
                             f"| {_f(c['warm_tok_s'])} | {_f(ratio)} | "
                             f"{_f(c['cold_ttft_ms'], '{:.0f}')} | {_f(c['warm_ttft_ms'], '{:.0f}')} |")
        srv = [x for x in res["servers"] if x["setup"] == s]
        if srv:
            lines += ["", "Memory: the KV cache vLLM sized at start-up (tokens; on CPU the space is "
                      "`VLLM_CPU_KVCACHE_SPACE`, shared with the draft's KV) and the server's resident "
                      "memory, all processes:", "",
                      "| arm | ready (s) | KV cache (tokens) | resident at ready (GiB) | peak (GiB) |",
                      "|---|---|---|---|---|"]
            for x in sorted(srv, key=lambda x: (ORDER.index(x["arm"]), x.get("round", 1))):
                name = x["arm"] + (f" (round {x['round']})" if rounds > 1 else "")
                lines.append(f"| {name} | {x['ready_s']} | "
                             f"{_f(x['kv_tokens'], '{:,}')} | {x['rss_ready_gib']} | "
                             f"{x.get('rss_peak_gib', '-')} |")
        noise = [n for n in res["noise"] if n["setup"] == s]
        if noise:
            spread = max(n["spread"] for n in noise)
            lines += ["", f"Noise: the first cell ({noise[0]['workload']}, {noise[0]['load']}) ran "
                      f"again last on each arm's server; the largest spread was "
                      f"{100 * spread:.0f}% (" + ", ".join(f"{n['arm']} {100 * n['spread']:.0f}%"
                                                       for n in noise) + ")."]
        lines.append("")
    misses = res["misses"]
    lines.append(f"Target: adaptive >= {TARGET} x the best of plain and the static arms, per cell. "
                 f"{len(res['cells']) - len(misses)} of "
                 f"{sum(1 for c in res['cells'] if c.get('adaptive_vs_best') is not None)} met.")
    for x in misses:
        lines.append(f"- MISSED: {x['setup']} {x['workload']} {x['load']}: {x['ratio']:.3f} of "
                     f"{x['best']}")
    for x in res.get("failures", []):
        where = x["cell"] or "server start"
        lines.append(f"- FAILED: {x['setup']} {x['arm']} {where}: "
                     + x["error"].splitlines()[0][:200])
    mism = res["mismatches"]
    if mism:
        lines += ["", f"**Greedy texts that differ from plain decoding** ({len(mism)} arm-cells):"]
        for x in mism:
            why = ("vLLM's own static K" if x["arm"] in STATIC else
                   "requests a static arm also changed (verification numerics)" if x["explained"]
                   else "NOT explained by a static arm")
            dtype = str(m.get("dtype", {}).get(x["setup"], ""))
            if not x["explained"] and "float32" not in dtype:
                why += f" (dtype {dtype}: exactness is checked in float32)"
            lines.append(f"- {x['setup']} {x['workload']} {x['load']} ({x['kind']}) {x['arm']}: "
                         f"requests {x['requests']}: {why}")
    else:
        lines += ["", "Every arm's greedy texts equal plain decoding's."]
    return "\n".join(lines) + "\n"


def write(res: dict, out: Path) -> None:
    m = res["meta"]
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(
        f"Command: `{m['command']}` at commit {m['commit']}  \nMachine: {m['machine']}, "
        f"vLLM {m['vllm']}, {m['date']}, {m['wall_minutes']} min\n\n" + markdown(res))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[served] matplotlib is not installed: no plots")
        return
    for s, title in m["setups"].items():
        cells = [c for c in res["cells"] if c["setup"] == s and c["load"].startswith("c=")]
        workloads = list(dict.fromkeys(c["workload"] for c in cells))
        if not workloads:
            continue
        arms = [a for a in ORDER if any(a in c["x_plain"] for c in cells)]
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8),
                                 squeeze=False, sharey=True)
        for ax, w in zip(axes[0], workloads):
            for a in arms:
                pts = sorted((int(c["load"][2:]), c["x_plain"].get(a)) for c in cells
                             if c["workload"] == w and c["x_plain"].get(a) is not None)
                style = dict(lw=2.5, color="black") if a == "adaptive" else dict(lw=1.2)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=a, **style)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(w)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
        axes[0][0].set_ylabel("output tok/s / plain decoding")
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"{title} (served, vllm bench serve)")
        fig.tight_layout()
        fig.savefig(out / f"served-speedup-{s}.png", dpi=110)
        plt.close(fig)
        # Per-request TPOT distributions, one panel per workload and load.
        keys = [k for k in res["tpots"] if k.startswith(s + "|")]
        panels = list(dict.fromkeys("|".join(k.split("|")[1:3]) for k in keys))
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
        for ax, p in zip(axes[0], panels):
            data = [(a, res["tpots"].get(f"{s}|{p}|{a}") or []) for a in arms]
            data = [(a, d) for a, d in data if d]
            ax.boxplot([d for _, d in data], showfliers=True)
            ax.set_xticks(range(1, len(data) + 1), [a for a, _ in data], rotation=45,
                          fontsize=7)
            ax.set_title(p.replace("|", " "), fontsize=9)
        axes[0][0].set_ylabel("TPOT per request (ms)")
        fig.suptitle(f"{title}: time per output token")
        fig.tight_layout()
        fig.savefig(out / f"served-tpot-{s}.png", dpi=110)
        plt.close(fig)
