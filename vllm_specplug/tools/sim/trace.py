"""Acceptance traces: a small JSONL schema, reading, writing, replay.

One JSON object per line; ``kind`` says which:

    {"kind": "header", "version": 1, "source": "sim 70b-1b switch c=8 seed=0", "max_k": 8}
    {"kind": "request", "req": "r12", "prompt_tokens": 512, "output_tokens": 240, "generated": 0}
    {"kind": "verify", "req": "r12", "step": 37, "drafted": 4, "accepted": 2}

- ``header`` (optional, first line): ``version`` must be 1.
- ``request`` (optional per request): ``prompt_tokens`` the prompt length,
  ``output_tokens`` the tokens still to generate when the trace starts,
  ``generated`` the tokens already generated then (requests caught
  mid-flight; 0 otherwise).  Without it the replay draws lengths from the
  setup's distributions.
- ``verify``: one verification of one request in one engine step: ``drafted``
  drafts were offered, the first ``accepted`` of them were accepted
  (0 <= accepted <= drafted).  ``step`` orders a request's records; records
  with ``drafted == 0`` carry no acceptance information and are skipped.

This is what the plugin sees per request in ``update_from_output`` (and what
vLLM's ``--per-request-spec-decode-metrics detailed`` returns), so a recorded
run of the real plugin converts to it line by line.  The plugin's own
decision trace (``additional_config["specplug"]["trace_path"]``) is read as
is: its ``{"event": "verify", "step": n, "requests": {req: [drafted,
accepted]}}`` lines are verifications, its ``plan`` lines are skipped.

Replay: the i-th verification of a simulated request uses the i-th
acceptance record of its trace request (cycling when the simulated request
lives longer).  A record with ``accepted < drafted`` fixes the run of
agreeing drafts at that point to exactly ``accepted``; one with ``accepted ==
drafted`` says only "at least ``drafted``" (censored) and is extended with a
geometric draw at the request's own maximum-likelihood acceptance.  A
replayed policy that offers ``k`` drafts gets ``min(k, run)`` accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

VERSION = 1


class TraceError(ValueError):
    pass


@dataclass
class TraceRequest:
    req: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    generated: int = 0
    records: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)

    def alpha(self) -> float:
        """Maximum-likelihood conditional acceptance of a geometric run
        length, censored records included (successes / trials)."""
        succ = sum(a for _, a in self.records)
        fails = sum(1 for d, a in self.records if a < d)
        return (succ + 0.5) / (succ + fails + 1.0)

    def emitted(self) -> int:
        return sum(a + 1 for _, a in self.records)


@dataclass
class Trace:
    requests: list[TraceRequest]
    header: dict = field(default_factory=dict)

    def records(self) -> list[dict]:
        out = []
        if self.header:
            out.append({"kind": "header", **self.header})
        for r in self.requests:
            rec = {"kind": "request", "req": r.req}
            if r.prompt_tokens is not None:
                rec["prompt_tokens"] = r.prompt_tokens
            if r.output_tokens is not None:
                rec["output_tokens"] = r.output_tokens
            rec["generated"] = r.generated
            out.append(rec)
        for r in self.requests:
            for i, (d, a) in enumerate(r.records):
                out.append({"kind": "verify", "req": r.req, "step": i, "drafted": d,
                            "accepted": a})
        return out


def write_trace(path: str | Path, trace: Trace) -> None:
    with open(path, "w") as f:
        for rec in trace.records():
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _int(rec: dict, key: str, where: str, minimum: int = 0) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def read_trace(path: str | Path) -> Trace:
    header: dict = {}
    reqs: dict[str, TraceRequest] = {}
    verifies: dict[str, list[tuple[int, int, int]]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            if "event" in rec and "kind" not in rec:  # the plugin's decision trace
                if rec["event"] != "verify":
                    continue
                reqs_in = rec.get("requests")
                if not isinstance(reqs_in, dict):
                    raise TraceError(f"{where}: 'requests' must be an object")
                step = rec.get("step", n)
                for req, pair in reqs_in.items():
                    if (not isinstance(pair, list) or len(pair) != 2
                            or not all(isinstance(v, int) and v >= 0 for v in pair)):
                        raise TraceError(f"{where}: request {req!r}: expected "
                                         f"[drafted, accepted], got {pair!r}")
                    d, a = pair
                    if a > d:
                        raise TraceError(f"{where}: request {req!r}: accepted ({a}) > "
                                         f"drafted ({d})")
                    reqs.setdefault(req, TraceRequest(req))
                    verifies.setdefault(req, []).append((step, d, a))
                continue
            kind = rec.get("kind")
            if kind == "header":
                if rec.get("version", VERSION) != VERSION:
                    raise TraceError(f"{where}: version {rec.get('version')!r} "
                                     f"not supported (only {VERSION})")
                header = {k: v for k, v in rec.items() if k != "kind"}
                continue
            req = rec.get("req")
            if not isinstance(req, str) or not req:
                raise TraceError(f"{where}: 'req' must be a non-empty string")
            if kind == "request":
                r = reqs.setdefault(req, TraceRequest(req))
                if "prompt_tokens" in rec:
                    r.prompt_tokens = _int(rec, "prompt_tokens", where)
                if "output_tokens" in rec:
                    r.output_tokens = _int(rec, "output_tokens", where, 1)
                if "generated" in rec:
                    r.generated = _int(rec, "generated", where)
            elif kind == "verify":
                d = _int(rec, "drafted", where)
                a = _int(rec, "accepted", where)
                if a > d:
                    raise TraceError(f"{where}: accepted ({a}) > drafted ({d})")
                step = _int(rec, "step", where) if "step" in rec else n
                reqs.setdefault(req, TraceRequest(req))
                verifies.setdefault(req, []).append((step, d, a))
            else:
                raise TraceError(f"{where}: 'kind' must be header, request or verify, "
                                 f"got {kind!r}")
    for req, rows in verifies.items():
        rows.sort(key=lambda x: x[0])
        reqs[req].records = [(d, a) for _, d, a in rows if d > 0]
    requests = list(reqs.values())  # order of first appearance = creation order
    if not any(r.records for r in requests):
        raise TraceError(f"{path}: no request has a verification with drafted > 0")
    return Trace(requests, header)
