"""The interleaved A/B's statistics and report (``ab.py`` runs it): per cell the paired
ratio of the adaptive arm over each other arm with a bootstrap interval over waves,
``results.md``, ``results.json``, ``ab-ratios.png`` and ``ab-speedup.png``; with the
decision trace, the instrument's own reading where the two arms cannot differ
(``mark_drafting``, ``null_check``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BOOT = 2000   # bootstrap resamples of a cell's waves
LEVEL = 0.90  # the interval's coverage


def paired_ratio(a: list[dict], b: list[dict], rng=None) -> dict:
    """Arm a's pooled output tokens/s over arm b's, on the same waves, with a
    bootstrap 90% interval (waves resampled)."""
    by_a = {r["wave"]: r for r in a}
    by_b = {r["wave"]: r for r in b}
    waves = sorted(set(by_a) & set(by_b))
    if not waves:
        return {}
    ta = np.array([by_a[w]["total_output_tokens"] for w in waves], dtype=float)
    da = np.array([by_a[w]["duration"] for w in waves], dtype=float)
    tb = np.array([by_b[w]["total_output_tokens"] for w in waves], dtype=float)
    db = np.array([by_b[w]["duration"] for w in waves], dtype=float)
    point = (ta.sum() / da.sum()) / (tb.sum() / db.sum())
    rng = rng or np.random.default_rng(0)
    idx = rng.integers(0, len(waves), size=(BOOT, len(waves)))
    boot = (ta[idx].sum(1) / da[idx].sum(1)) / (tb[idx].sum(1) / db[idx].sum(1))
    lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return dict(ratio=round(float(point), 4), lo=round(float(lo), 4), hi=round(float(hi), 4),
                waves=len(waves))


def mark_drafting(runs: list[dict], out: Path) -> list[dict]:
    """``runs`` with ``drafted`` set on each adaptive run the decision trace
    (``logs/<setup>-ab-trace.jsonl``, ``--trace``) covers: whether the plugin
    planned a draft for any of its requests.  A run is found by its request
    ids' prefix (``request_id_prefix``)."""
    traced = {}
    for setup in {r["setup"] for r in runs}:
        path = out / "logs" / f"{setup}-ab-trace.jsonl"
        if not path.is_file():
            continue
        most: dict[str, int] = {}
        with open(path) as f:
            for line in f:
                if '"plan"' not in line:
                    continue
                for rid, v in json.loads(line).get("requests", {}).items():
                    most[rid] = max(most.get(rid, 0), int(v.get("k", 0)))
        traced[setup] = most
    marked = []
    for r in runs:
        most = traced.get(r["setup"])
        prefix = r.get("request_id_prefix")
        if r["arm"] == "adaptive" and most is not None and prefix:
            ks = [k for rid, k in most.items() if prefix in rid]
            if ks:
                r = dict(r, drafted=max(ks) > 0)
        marked.append(r)
    return marked


def null_check(runs: list[dict]) -> dict:
    """Per setup, the waves where the adaptive arm drafted nothing (``mark_drafting``):
    it decoded as the plain arm does, so adaptive / plain there is what the
    instrument reads where there is no difference.  Its mean is the bias, its
    SD the noise, of one wave's ratio."""
    plain = {(r["setup"], r["workload"], r["concurrency"], r["repeat"], r["wave"]): r
             for r in runs if r["arm"] == "plain"}
    out = {}
    for r in runs:
        p = plain.get((r["setup"], r["workload"], r["concurrency"], r["repeat"], r["wave"]))
        if r["arm"] == "adaptive" and r.get("drafted") is False and p:
            rate = (r["total_output_tokens"] / r["duration"]) / (
                p["total_output_tokens"] / p["duration"])
            out.setdefault(r["setup"], []).append(rate)
    return {s: dict(waves=len(v), mean=round(float(np.mean(v)), 4),
                    sd=round(float(np.std(v, ddof=1)), 4) if len(v) > 1 else None,
                    lowest=round(min(v), 4), highest=round(max(v), 4))
            for s, v in out.items()}


def summarise(runs: list[dict], meta: dict, failures: list[dict]) -> dict:
    cells = []
    keys = list(dict.fromkeys((r["setup"], r["workload"], r["concurrency"], r["repeat"])
                              for r in runs))
    for s, w, c, rep in keys:
        group = [r for r in runs if (r["setup"], r["workload"], r["concurrency"], r["repeat"])
                 == (s, w, c, rep)]
        arms = list(dict.fromkeys(r["arm"] for r in group))
        per = {}
        for a in arms:
            rs = [r for r in group if r["arm"] == a]
            tok = sum(r["total_output_tokens"] for r in rs)
            dur = sum(r["duration"] for r in rs)
            tpots = [x for r in rs for x in r["tpots_ms"]]
            ttfts = [x for r in rs for x in r["ttfts_ms"]]
            per[a] = dict(tok_s=round(tok / dur, 3), waves=len(rs),
                          ttft_ms=round(float(np.mean(ttfts)), 1) if ttfts else None,
                          tpot_ms=round(float(np.mean(tpots)), 1) if tpots else None)
        fixed = [a for a in arms if a.startswith("k")]
        best = max(fixed, key=lambda a: per[a]["tok_s"]) if fixed else None
        ada = [r for r in group if r["arm"] == "adaptive"]
        ratios = {a: paired_ratio(ada, [r for r in group if r["arm"] == a])
                  for a in arms if a != "adaptive"}
        texts = {}
        for r in group:
            for i, t in enumerate(r["texts"]):
                texts.setdefault((r["wave"], i), {})[r["arm"]] = t
        differs = sorted({a for v in texts.values() for a, t in v.items()
                          if "plain" in v and t != v["plain"]})
        cells.append(dict(setup=s, workload=w, concurrency=c, repeat=rep, arms=per,
                          best_fixed=best, vs=ratios, differs_from_plain=differs))
    return dict(meta=meta, cells=cells, failures=failures, null_check=null_check(runs), runs=[
        {k: v for k, v in r.items() if k not in ("texts", "tpots_ms", "ttfts_ms")}
        for r in runs])


def _ci(v: dict) -> str:
    return f"{v['ratio']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]" if v else "-"


def markdown(res: dict) -> str:
    lines = []
    for s, title in res["meta"]["setups"].items():
        cells = [c for c in res["cells"] if c["setup"] == s]
        if not cells:
            continue
        arms = list(cells[0]["arms"])
        lines += [f"### {title}", "",
                  "Output tokens/s per arm (all on one server, waves interleaved); adaptive over "
                  "plain and over the cell's best fixed k, with bootstrap 90% intervals over "
                  "waves.  TTFT and TPOT (mean time per output token after the first) split "
                  "a ratio into the prompt's step, where a drafting arm also runs the draft over "
                  "the prompt, and decoding.", "",
                  "| workload | c | waves | " + " | ".join(arms)
                  + " | best fixed | adaptive / plain | adaptive / best fixed | TTFT ms "
                    "(adaptive / plain) | TPOT ms (adaptive / plain) | greedy text differs |",
                  "|---|---|---|" + "---|" * len(arms) + "---|---|---|---|---|---|"]
        for c in cells:
            best = c["best_fixed"]
            both = "adaptive" in c["arms"] and "plain" in c["arms"]
            ttft, tpot = ((f"{c['arms']['adaptive'][m]:.0f} / {c['arms']['plain'][m]:.0f}"
                           if both else "-") for m in ("ttft_ms", "tpot_ms"))
            lines.append(
                f"| {c['workload']}{' (repeat)' if c['repeat'] else ''} | {c['concurrency']} | "
                f"{c['arms'][arms[0]]['waves']} | "
                + " | ".join(f"{c['arms'][a]['tok_s']:.2f}" if a in c["arms"] else "-"
                             for a in arms)
                + f" | {best or '-'} | {_ci(c['vs'].get('plain', {}))} | "
                  f"{_ci(c['vs'].get(best, {})) if best else '-'} | {ttft} | {tpot} | "
                  f"{', '.join(c['differs_from_plain']) or 'none'} |")
        main = [c for c in cells if not c["repeat"]]
        vp = [c["vs"]["plain"]["ratio"] for c in main if c["vs"].get("plain")]
        vb = [c["vs"][c["best_fixed"]]["ratio"] for c in main
              if c["best_fixed"] and c["vs"].get(c["best_fixed"])]
        rep = [c for c in cells if c["repeat"]]
        first = next((c for c in main if rep and (c["workload"], c["concurrency"]) ==
                      (rep[0]["workload"], rep[0]["concurrency"])), None)
        lines += ["", f"Adaptive >= 0.98x plain in {sum(v >= 0.98 for v in vp)} of {len(vp)} "
                      f"cells (lowest {min(vp, default=float('nan')):.3f}); >= 0.97x the best "
                      f"fixed k in {sum(v >= 0.97 for v in vb)} of {len(vb)} (lowest "
                      f"{min(vb, default=float('nan')):.3f})."]
        if first and rep:
            b = first["best_fixed"]
            r1, r2 = first["vs"].get(b, {}).get("ratio"), rep[0]["vs"].get(b, {}).get("ratio")
            if r1 and r2:
                lines.append(f"Repeatability: the first cell's adaptive / {b} was {r1:.3f}, run "
                             f"again at the end {r2:.3f} ({100 * (r2 / r1 - 1):+.1f}%).")
        null = res.get("null_check", {}).get(s)
        if null and null["sd"] is not None:
            lines.append(
                f"No-difference check (decision trace): in {null['waves']} waves the adaptive arm "
                f"drafted nothing, decoding as plain does; adaptive / plain there was "
                f"{null['mean']:.3f} on average, SD {null['sd']:.3f} a wave (lowest "
                f"{null['lowest']:.3f}, highest {null['highest']:.3f}): the instrument's bias "
                f"and noise where the arms cannot differ.")
        lines.append("")
    for f in res["failures"]:
        lines.append(f"FAILED: {f['setup']} {f.get('arm')} {f.get('cell')}: {f['error'][:200]}")
    return "\n".join(lines)


def write(res: dict, out: Path) -> None:
    m = res["meta"]
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(
        f"Command: `{m['command']}` at commit {m['commit']}  \nMachine: {m['machine']}, "
        f"vLLM {m['vllm']}, dtype {m['dtype']}, {m['date']}, {m['wall_minutes']} min\n\n"
        + markdown(res))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[ab] matplotlib is not installed: no plot")
        return
    setups = [s for s in m["setups"] if any(c["setup"] == s for c in res["cells"])]
    fig, axes = plt.subplots(1, len(setups), figsize=(6.5 * len(setups), 4.2), squeeze=False)
    for ax, s in zip(axes[0], setups):
        cells = [c for c in res["cells"] if c["setup"] == s and not c["repeat"]]
        x = np.arange(len(cells))
        for off, (label, pick, color) in enumerate((
                ("adaptive / plain", lambda c: c["vs"].get("plain"), "tab:grey"),
                ("adaptive / best fixed k", lambda c: c["vs"].get(c["best_fixed"] or ""),
                 "black"))):
            vals = [pick(c) or {} for c in cells]
            y = np.array([v.get("ratio", np.nan) for v in vals])
            err = np.array([[v.get("ratio", np.nan) - v.get("lo", np.nan) for v in vals],
                            [v.get("hi", np.nan) - v.get("ratio", np.nan) for v in vals]])
            ax.errorbar(x + 0.15 * (off - 0.5), y, yerr=err, fmt="o", color=color, label=label,
                        capsize=3)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(x, [f"{c['workload']}\nc={c['concurrency']}" for c in cells], fontsize=7)
        ax.set_title(m["setups"][s], fontsize=9)
        ax.set_ylabel("paired ratio (90% interval)")
        ax.legend(fontsize=7)
    fig.suptitle("Interleaved A/B on one server: the adaptive choice over plain and over the "
                 "best fixed k", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "ab-ratios.png", dpi=110)
    plt.close(fig)
    plot_speedup(res, setups, out / "ab-speedup.png", plt)


def plot_speedup(res: dict, setups: list[str], path: Path, plt) -> None:
    """Speedup over plain decoding against load, per workload: the adaptive arm
    (solid, its 90% interval) and the cell's best fixed k (dashed, point)."""
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4.0), squeeze=False)
    for ax, s in zip(axes[0], setups):
        cells = [c for c in res["cells"] if c["setup"] == s and not c["repeat"]
                 and c["vs"].get("plain")]
        loads = sorted({c["concurrency"] for c in cells})
        for i, w in enumerate(dict.fromkeys(c["workload"] for c in cells)):
            row = sorted((c for c in cells if c["workload"] == w), key=lambda c: c["concurrency"])
            x = [loads.index(c["concurrency"]) + 0.06 * (i - 1.5) for c in row]
            v = [c["vs"]["plain"] for c in row]
            line = ax.errorbar(x, [r["ratio"] for r in v],
                               yerr=[[r["ratio"] - r["lo"] for r in v],
                                     [r["hi"] - r["ratio"] for r in v]],
                               fmt="-o", capsize=3, label=f"{w}: adaptive")
            best = [c["arms"][c["best_fixed"]]["tok_s"] / c["arms"]["plain"]["tok_s"]
                    if c["best_fixed"] else np.nan for c in row]
            ax.plot(x, best, "--", marker="x", color=line[0].get_color(), alpha=0.7,
                    label=f"{w}: best fixed k")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(loads)), [f"{c} request{'s' if c > 1 else ''}" for c in loads])
        ax.set_title(res["meta"]["setups"][s], fontsize=9)
        ax.set_ylabel("output tokens/s over plain decoding")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Served speedup over load (interleaved A/B on one server; bars: 90% interval)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
