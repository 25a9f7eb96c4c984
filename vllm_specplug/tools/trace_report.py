"""Reading a decision trace: K over time, the draft's confidence, and the CLI.

The trace itself is written by the engine core (``vllm_specplug/trace.py``,
``DecisionTrace``, whose docstring gives the format).  Here it is read
back: ``vllm-specplug trace plot TRACE.jsonl -o k.png`` draws K per request
over steps; ``vllm-specplug trace confidence TRACE.jsonl`` prints the passes
the confidence stop saved and the calibration table, and plots it.
"""

from __future__ import annotations

import argparse
import json


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_k_over_time(records: list[dict], out: str, max_requests: int = 24) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[int]]] = {}
    for r in records:
        if r.get("event") != "plan":
            continue
        for rid, info in r["requests"].items():
            xs, ys = series.setdefault(rid, ([], []))
            xs.append(r["step"])
            ys.append(info["k"])
    fig, ax = plt.subplots(figsize=(10, 5))
    for rid in list(series)[:max_requests]:
        xs, ys = series[rid]
        ax.step(xs, ys, where="post", label=rid[:16], alpha=0.8)
    ax.set_xlabel("engine step")
    ax.set_ylabel("drafts granted (k)")
    ax.set_title("K chosen per request over time")
    if len(series) <= 12:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def drafting_summary(records: list[dict]) -> dict:
    """What the draft's confidence did over a trace: passes, tokens, outcomes."""
    sent = run = steps = 0
    drafted = accepted = 0
    planned = {r["step"]: r.get("k_step_sent", r["k_step"]) for r in records
               if r.get("event") == "plan"}
    for r in records:
        if r.get("event") != "verify":
            continue
        for d, a in r["requests"].values():
            drafted += d
            accepted += a
        if "draft_passes" in r and planned.get(r["step"], 0) > 0:
            steps += 1
            sent += planned[r["step"]]
            run += r["draft_passes"]
    return {"drafting_steps": steps, "passes_scheduled": sent, "passes_run": run,
            "passes_saved": (1.0 - run / sent) if sent else None,
            "verified": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_pass": accepted / run if run else None}


def replay_calibration(records: list[dict], cal=None):
    """The calibration replayed online over a trace's verified drafts: per draft
    (the accepted ones and the first rejection), before its step is observed,
    ``(position, confidence, bin, chance the calibration gave it, accepted)``.
    ``cal``: a fresh ``ConfidenceCalibration`` (default: 16 positions)."""
    import numpy as np

    from vllm_specplug.controller.confidence import ConfidenceCalibration, bins

    cal = ConfidenceCalibration(16) if cal is None else cal
    for r in records:
        if r.get("event") != "verify" or not r.get("confidence"):
            continue
        confs, accs = [], []
        for rid, conf in r["confidence"].items():
            a = r["requests"][rid][1]
            seen = np.asarray(conf[: min(a + 1, len(conf), cal.width)], dtype=np.float64)
            positions = np.arange(seen.size)
            yield from zip(positions.tolist(), seen.tolist(), bins(cal.edges, seen).tolist(),
                           cal.predict(positions, seen).tolist(), (positions < a).tolist())
            confs.append(conf)
            accs.append(a)
        cal.observe(confs, accs)


def calibration_table(records: list[dict]) -> list[dict]:
    """Per confidence bin: the verified drafts' outcomes, and the chance the
    calibration gave each before it was verified (``replay_calibration``: the
    bin's acceptance so far, the position's pooled acceptance as its prior)."""
    from vllm_specplug.controller.confidence import EDGES

    rows = [dict(n=0, accepted=0, conf=0.0, predicted=0.0) for _ in range(EDGES.size + 1)]
    for _, c, b, chance, ok in replay_calibration(records):
        row = rows[b]
        row["n"] += 1
        row["accepted"] += int(ok)
        row["conf"] += c
        row["predicted"] += chance
    edges = [0.0, *EDGES.tolist(), 1.0]
    return [{"bin": f"{edges[i]:.3g}-{edges[i + 1]:.3g}", "n": row["n"],
             "confidence": row["conf"] / row["n"] if row["n"] else None,
             "observed": row["accepted"] / row["n"] if row["n"] else None,
             "predicted": row["predicted"] / row["n"] if row["n"] else None}
            for i, row in enumerate(rows)]


def plot_calibration(records: list[dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = [t for t in calibration_table(records) if t["n"]]
    fig, ax = plt.subplots(figsize=(6, 5))
    x = [t["confidence"] for t in table]
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="confidence = acceptance")
    ax.plot(x, [t["observed"] for t in table], "o-", label="observed acceptance")
    ax.plot(x, [t["predicted"] for t in table], "s--", label="calibrated chance (online)")
    for t in table:
        ax.annotate(str(t["n"]), (t["confidence"], t["observed"]), fontsize=7,
                    textcoords="offset points", xytext=(3, -10))
    ax.set_xlabel("draft's probability of its token (bin mean)")
    ax.set_ylabel("target accepts the draft")
    ax.set_title("Draft confidence vs acceptance (n per bin)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vllm-specplug trace")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plot", help="plot K over time per request")
    pl.add_argument("trace")
    pl.add_argument("-o", "--out", default="k_over_time.png")
    pl.add_argument("--max-requests", type=int, default=24)
    cb = sub.add_parser("confidence", help="the draft's confidence: passes saved, "
                        "calibration table and plot")
    cb.add_argument("trace")
    cb.add_argument("-o", "--out", default="calibration.png")
    args = p.parse_args(argv)
    records = read_trace(args.trace)
    if args.cmd == "confidence":
        print(json.dumps(drafting_summary(records), indent=1))
        print("bin | n | confidence | observed | predicted")
        for t in calibration_table(records):
            print(" | ".join(str(t[k] if not isinstance(t[k], float) else round(t[k], 3))
                             for k in ("bin", "n", "confidence", "observed", "predicted")))
        print(plot_calibration(records, args.out))
        return 0
    out = plot_k_over_time(records, args.out, args.max_requests)
    plans = sum(1 for r in records if r.get("event") == "plan")
    print(f"{out}: {plans} planned steps")
    return 0
