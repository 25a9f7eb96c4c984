"""Score the acceptance estimator on recorded decision traces of real vLLM.

A decision trace (``additional_config["specplug"]["trace_path"]``, written
by every adaptive arm of ``python -m vllm_specplug.tools.bench --served --trace``)
holds, step by step, the requests in the batch and what vLLM verified for
each: drafts offered and accepted.  This replays those outcomes, in order,
through the estimator of the checkout it runs from and asks, before each
verification, how likely the estimator found what happened next:

- ``log-lik``: mean log-likelihood of the verified outcomes (positions
  accepted, then the first rejection when there is one); higher is better.
- ``bias``: mean of expected minus accepted drafts for the drafts offered;
  positive when the estimator is too hopeful.

The estimator's decisions do not feed back (the drafts offered are those of
the recorded run), so two checkouts compare on the same outcomes.  Rows are
split by endpoint (in the served benchmark HumanEval is sent to
``/v1/completions``, ShareGPT to ``/v1/chat/completions``), by batch size at
planning time, and by a request's first five verifications against the rest.

    python benchmarks/estimator_replay.py                      # the recorded served runs
    python benchmarks/estimator_replay.py run/logs/*-trace.jsonl
"""

from __future__ import annotations

import argparse
import glob
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_specplug.controller import ControllerSettings, SpecController
from vllm_specplug.tools.trace_report import read_trace

RESULTS = Path(__file__).resolve().parent / "results"
EARLY = 5


def replay(path: str, totals: dict) -> None:
    # The estimator as the controller builds it from the default settings.
    est = SpecController(ControllerSettings(max_k=8)).estimator
    seen: dict[str, int] = defaultdict(int)
    batch, verified_last, live = 1, set(), set()
    for r in read_trace(path):
        if r["event"] == "plan":
            planned = set(r["requests"])
            # A request gone from the plan, with no verification pending, finished.
            for rid in live - planned - verified_last:
                est.remove(rid)
            live = (live & verified_last) | planned
            for rid in planned:
                est.add(rid)
            batch = r["batch"]
            continue
        verified_last = set(r["requests"])
        rids = [rid for rid, (d, _) in r["requests"].items() if d > 0]
        if not rids:
            continue
        live.update(rids)
        rows = np.array([est.add(rid) for rid in rids])
        surv = np.clip(est.survival(rows), 1e-6, 1.0)
        for i, rid in enumerate(rids):
            drafted, accepted = r["requests"][rid]
            seen[rid] += 1
            s_ = np.concatenate([[1.0], surv[i]])
            alpha = np.clip(s_[1:] / s_[:-1], 0.02, 0.98)
            ll = float(np.log(alpha[:accepted]).sum())
            if accepted < drafted:
                ll += math.log(1.0 - alpha[accepted])
            key = ("chat" if rid.startswith("chat") else "completions",
                   "c=1" if batch <= 1 else "c>1",
                   "first %d" % EARLY if seen[rid] <= EARLY else "later")
            totals[key] += np.array([ll, s_[1:drafted + 1].sum() - accepted, 1.0])
        est.observe_rows(rows, np.array([r["requests"][x][0] for x in rids]),
                         np.array([r["requests"][x][1] for x in rids]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files (default: the recorded served runs)")
    args = ap.parse_args(argv)
    paths = args.traces or sorted(glob.glob(str(RESULTS / "served-*" / "logs" / "*trace*.jsonl")))
    if not paths:
        raise SystemExit("no traces found")
    totals: dict = defaultdict(lambda: np.zeros(3))
    for p in paths:
        replay(p, totals)
    print(f"{len(paths)} traces")
    print("| endpoint | batch | verifications | n | log-lik | bias |")
    print("|---|---|---|---|---|---|")
    whole = np.zeros(3)
    for key in sorted(totals):
        ll, bias, n = totals[key]
        whole += totals[key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {int(n)} | {ll / n:.3f} | {bias / n:+.3f} |")
    ll, bias, n = whole
    print(f"| all | | | {int(n)} | {ll / n:.4f} | {bias / n:+.3f} |")


if __name__ == "__main__":
    main()
