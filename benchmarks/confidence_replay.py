"""What the confidence calibration's constants are worth, on recorded served traces.

    .venv/bin/python benchmarks/confidence_replay.py [TRACE.jsonl ...]

Replays every verified draft of the traces (default: the kept served runs
with ``draft_confidence`` on, ``benchmarks/results/*/logs/*-trace.jsonl``
whose steps carry confidences) through ``ConfidenceCalibration`` online, as
``vllm-specplug trace confidence`` does: each draft's chance is the
calibration's before its step is observed.  Each trace starts cold (one
server each).  Per variant (one constant of ``controller/confidence.py``
changed): the log loss and the Brier score of those chances against what
the target accepted, pooled over the traces, and their change against the
default.  ``confidence unused`` is the position's pooled rate alone: what
the confidence adds is the gap to it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import sys
from pathlib import Path
from unittest.mock import patch

import numpy as np

import vllm_specplug.controller.confidence as confidence
from vllm_specplug.controller.confidence import ConfidenceCalibration
from vllm_specplug.tools.trace_report import replay_calibration

ROOT = Path(__file__).resolve().parent

# name -> (module constants, bin edges or None for the default).
VARIANTS = {
    "default": ({}, None),
    "confidence unused": ({"PRIOR_WEIGHT": 1e12}, None),
    "PRIOR_WEIGHT=1": ({"PRIOR_WEIGHT": 1.0}, None),  # 4
    "PRIOR_WEIGHT=16": ({"PRIOR_WEIGHT": 16.0}, None),
    "EDGES: 4 even bins": ({}, np.array([0.25, 0.5, 0.75])),
    "EDGES: 0.5, 0.9, 0.99": ({}, np.array([0.5, 0.9, 0.99])),
    "EDGES: 16 bins": ({}, np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95,
                                     0.97, 0.98, 0.99, 0.995])),
}


def traces(paths: list[str]) -> list[list[dict]]:
    out = []
    for path in paths:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if any(r.get("event") == "verify" and r.get("confidence") for r in records):
            out.append(records)
    return out


def score(runs: list[list[dict]], constants: dict, edges) -> dict:
    chances, outcomes = [], []
    with patch.multiple(confidence, **constants) if constants else contextlib.nullcontext():
        for records in runs:
            cal = ConfidenceCalibration(16, confidence.EDGES if edges is None else edges)
            for _, _, _, chance, ok in replay_calibration(records, cal):
                chances.append(chance)
                outcomes.append(ok)
    p = np.clip(np.array(chances), 1e-6, 1 - 1e-6)
    y = np.array(outcomes, dtype=np.float64)
    return {"drafts": int(y.size), "accepted": float(y.mean()),
            "log_loss": float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()),
            "brier": float(((p - y) ** 2).mean())}


def main() -> None:
    paths = sys.argv[1:] or sorted(glob.glob(str(ROOT / "results" / "*" / "logs" /
                                                 "*-trace.jsonl")))
    runs = traces(paths)
    if not runs:
        sys.exit("no trace with the draft's confidence among " + ", ".join(paths))
    base = score(runs, *VARIANTS["default"])
    print(f"{len(runs)} traces with confidences, {base['drafts']} verified drafts, "
          f"{base['accepted']:.3f} accepted\n")
    print("| variant | log loss | vs default | Brier | vs default |")
    print("|---|---:|---:|---:|---:|")
    for name, (constants, edges) in VARIANTS.items():
        s = score(runs, constants, edges)
        print(f"| {name} | {s['log_loss']:.4f} | {s['log_loss'] / base['log_loss']:.3f} | "
              f"{s['brier']:.4f} | {s['brier'] / base['brier']:.3f} |")


if __name__ == "__main__":
    main()
