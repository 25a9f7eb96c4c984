"""An opt-in decision trace (JSON Lines), written by the engine core.

Turn it on with ``additional_config["specplug"]["trace_path"]``.  The engine
core appends one line per event (with data parallelism, each rank writes
``PATH.rankN``):

- ``{"event": "plan", "step": n, "t": seconds, "k_step": K, "batch": B,
  "predicted_s": ..., "plain_s": ..., "predicted_speedup": ...,
  "requests": {req_id: {"k": k, "acceptance": a1, "expected": e}, ...}}``
  where ``acceptance`` is the estimated probability that the request's first
  draft is accepted and ``expected`` the expected accepted drafts for the k
  granted (why it got k);
- ``{"event": "verify", "step": n, "t": ..., "measured_s": seconds or null,
  "requests": {req_id: [drafted, accepted], ...}, "draft_passes": n,
  "confidence": {req_id: [c1, ...]}}``: what vLLM verified in
  the step and what was accepted, as vLLM counts it (its spec-decode
  counters sum the same numbers).

Reading and plotting a trace is a tool's job (``tools/trace_report.py``):
``vllm-specplug trace plot TRACE.jsonl -o k.png`` draws K per request over
steps.
"""

from __future__ import annotations

import json
import time


class DecisionTrace:
    """Appends events to a JSON Lines file, one line each, flushed as written."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)
        self._t0 = time.monotonic()

    def plan(self, step: int, decision, req_ids, k_step_sent: int | None = None) -> None:
        """The plan ``decision`` for ``req_ids``, with the survival it read."""
        surv = decision.survival
        requests = {}
        for i, (rid, k) in enumerate(zip(req_ids, decision.k.tolist())):
            s = surv[i]
            requests[rid] = {"k": k, "acceptance": round(float(max(s[0], 0.0)), 4),
                             "expected": round(float(max(s[:k].sum(), 0.0)), 4)}
        self._write({"event": "plan", "step": step, "t": self._now(),
                     "k_step": int(decision.k_step), "batch": len(req_ids),
                     **({"k_step_sent": int(k_step_sent)} if k_step_sent is not None
                        and k_step_sent != decision.k_step else {}),
                     "predicted_s": _num(decision.predicted_seconds),
                     "plain_s": _num(decision.plain_seconds),
                     "predicted_speedup": _num(decision.predicted_speedup),
                     "requests": requests})

    def verify(self, step: int, measured_s, verified: dict[str, list[int]],
               draft_passes: int | None = None, confidence: dict | None = None) -> None:
        record = {"event": "verify", "step": step, "t": self._now(),
                  "measured_s": _num(measured_s), "requests": verified}
        if draft_passes is not None:
            record["draft_passes"] = int(draft_passes)
        if confidence:
            record["confidence"] = {rid: [round(float(c), 4) for c in cs]
                                    for rid, cs in confidence.items()}
        self._write(record)

    def close(self) -> None:
        self._file.close()

    def _now(self) -> float:
        return round(time.monotonic() - self._t0, 6)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")


def _num(x):
    if x is None:
        return None
    x = float(x)
    return round(x, 9) if x == x and abs(x) != float("inf") else None
