"""Served benchmark: each arm a real server, driven by vLLM's own client.

    python -m vllm_specplug.tools.bench --served --quick     # ~13 min: Qwen pair, HumanEval + ShareGPT, c=1,4
    python -m vllm_specplug.tools.bench --served             # the full grid (~1 h here; says so up front)

Per arm, ``vllm-specplug serve`` starts once and ``vllm bench serve`` (vLLM's
own client, run in this process through its library entry point) measures every cell
against it: output tokens/s, TTFT, TPOT and ITL (mean, p50, p99) at each
concurrency and at one Poisson request rate.  Arms:

- ``plain``: no speculation;
- ``vllm-k2``, ``vllm-k4``: vLLM's own static K with vLLM's scheduler, the
  plugin not loaded (``VLLM_PLUGINS``): what a user would run instead;
  ``vllm-k6``, ``vllm-k8`` the same (not in the default grid);
- ``vllm-table``: vLLM's batch-size table (``num_speculative_tokens_per_batch_size``);
- ``plugin-k2``: the plugin loaded, its scheduler and patches on, at vLLM's K=2
  (``policy: static``): what the plugin's own path costs, apart from its policy;
- ``plugin-k0``: the same at K=0 on the speculative engine (no draft token
  scheduled): the floor a fallback reaches on that engine (not in the default grid);
- ``adaptive``: the plugin's adaptive policy with the shipped ceiling, its
  default settings (the draft's confidence on where it applies).
- ``adaptive-history``: the same with the draft's confidence off
  (``draft_confidence: false``: K from history alone; not in the default grid).

The first run after a server is up is its cold run (other prompts than the
grid's, no warm-up, vLLM's ready-check request turned off); every cell
after it is warm.  The grid's first cell runs again last on each arm's
server: that repeat's spread is the cell noise the report states.
``--rounds N`` runs the whole arm sequence N times, a fresh server per arm
and round, the order reversed every other round (plain ... adaptive, then
adaptive ... plain), so that a drift of the host over the run falls on
every arm alike; a cell's tokens/s is then its output tokens over its
duration summed over the rounds, and the report lists each round's ratio
and a 90% confidence interval of it.  ``--pool DIR DIR ... --out DIR``
pools the rounds of finished runs of one grid into one report.
Every arm's greedy texts are compared with plain decoding's (temperature 0,
a fixed output length; a difference no static arm shares fails the run in
float32 and is listed in bfloat16), and the memory each arm takes is recorded: the KV
cache capacity vLLM reports at start-up and the server's resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from vllm_specplug.tools.bench.runner import Progress
from vllm_specplug.tools.bench.served_report import ORDER as ARMS
from vllm_specplug.tools.bench.server import (Server, free_port, resident_gib, server_command,
                                              server_env)
from vllm_specplug.tools.bench.served_client import per_request, raw_path, run_cell
from vllm_specplug.tools.bench.served_grid import (Cell, cell_units, estimate_s, build_cells,
                                                   setup_models)
from vllm_specplug.tools.bench.setups import SERVED_SETUPS as SETUPS

QUICK = dict(setups=["qwen"], workloads=["humaneval", "sharegpt"], concurrency=[1, 4],
             arms=["plain", "vllm-k4", "adaptive"])


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m vllm_specplug.tools.bench --served",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--served", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="Qwen pair, HumanEval + ShareGPT, c=1,4, plain/vllm-k4/adaptive (~13 min)")
    p.add_argument("--setups", default="qwen,smollm-ngram", help=f"comma-separated: {', '.join(SETUPS)}")
    p.add_argument("--workloads", default=None,
                   help="comma-separated: humaneval, sharegpt, mixed, json (default: the setup's)")
    p.add_argument("--concurrency", default=None, help="comma-separated (default: the setup's)")
    p.add_argument("--arms", default=None,
                   help=f"comma-separated: {', '.join(ARMS)} (default: the setup's)")
    p.add_argument("--no-rate", action="store_true", help="skip the Poisson request-rate cell")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every arm this many times, the order reversed every other round; "
                        "cells pool their rounds (default 1)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in a c=1 cell (default the setup's: 3 for the real models)")
    p.add_argument("--cold-requests", type=int, default=None,
                   help="requests in the cold run, one at a time, right after each server is "
                        "up (default the setup's: 3 for the real models)")
    p.add_argument("--waves", type=int, default=2,
                   help="requests in a cell at concurrency c > 1, as a multiple of c (default 2)")
    p.add_argument("--trace", action="store_true",
                   help="the adaptive servers write their decision traces to logs/ "
                        "(vllm-specplug trace plot FILE draws one)")
    p.add_argument("--out", default="bench-served", help="output folder")
    p.add_argument("--render", default=None, metavar="DIR",
                   help="rewrite the report of a finished run in DIR from its results.json "
                        "and raw/ files; runs nothing")
    p.add_argument("--pool", nargs="+", default=None, metavar="DIR",
                   help="pool the rounds of finished runs of one grid (each DIR's results.json "
                        "and raw/ files) into one report in --out; runs nothing")
    p.add_argument("--tiny-root", default="/tmp/vllm-specplug-bench-tiny")
    p.add_argument("--data-cache", default=None, help="prompt-set cache (vllm-specplug data)")
    args = p.parse_args(argv)
    if args.quick:
        args.setups = ",".join(QUICK["setups"])
        args.workloads = ",".join(QUICK["workloads"])
        args.concurrency = ",".join(map(str, QUICK["concurrency"]))
        args.arms = ",".join(QUICK["arms"])
        args.no_rate = True
    for flag in ("rounds", "waves", "requests", "cold_requests"):
        n = getattr(args, flag)
        if n is not None and n < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: {n}; allowed: an integer >= 1")
    chosen = args.arms.split(",") if args.arms else ["plain"]
    bad = [a for a in chosen if a not in ARMS]
    if bad or "plain" not in chosen:
        raise SystemExit(f"--arms: unknown {bad}; known: {', '.join(ARMS)} (plain is required: "
                         "every ratio and the greedy comparison are against it)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        return render(Path(args.render))
    if args.pool:
        return pool([Path(d) for d in args.pool], Path(args.out))
    base_env = server_env()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan(args, out)
    total = args.rounds * sum(estimate_s(s, cells, a) for s, _, _, cells, a in plan)
    n_runs = args.rounds * sum(len(cells) * len(a) for _, _, _, cells, a in plan)
    print(f"[served] {n_runs} runs, {args.rounds * sum(len(a) for *_, a in plan)} server starts; "
          f"estimate {total / 60:.0f} min. Progress and time left follow on stderr.", flush=True)
    progress = Progress(total, "served")
    started = time.time()
    runs, servers, failures = [], [], []
    for rnd, (setup, target, draft, cells, setup_arms) in (
            (r, p) for r in range(args.rounds) for p in plan):
        for arm in (setup_arms if rnd % 2 == 0 else setup_arms[::-1]):
            _run_arm(args, out, base_env, progress, (setup, target, draft, cells), arm, rnd,
                     runs, servers, failures)
    return _report(argv, args, out, plan, started, runs, servers, failures)


def _plan(args, out: Path) -> list[tuple]:
    """Per setup: (setup, target path, draft path, its cells, its arms in order)."""
    plan = []
    for name in args.setups.split(","):
        setup, target, draft, tok = setup_models(name, args.tiny_root)
        workloads = args.workloads.split(",") if args.workloads else list(setup.workloads)
        conc = ([int(c) for c in args.concurrency.split(",")] if args.concurrency
                else list(setup.concurrency))
        cells = build_cells(setup, workloads, conc, not args.no_rate, out, tok, args.data_cache,
                            args.requests, args.waves, args.cold_requests)
        chosen = args.arms.split(",") if args.arms else setup.arms
        plan.append((setup, target, draft, cells, [a for a in ARMS if a in chosen]))
    return plan


def _run_arm(args, out: Path, base_env: dict, progress, entry: tuple, arm: str, rnd: int,
             runs: list, servers: list, failures: list) -> None:
    """One arm's server in one round: started, every cell run against it, stopped."""
    setup, target, draft, cells = entry
    max_c = max(c.concurrency for c in cells)
    if any(c.kind == "rate" for c in cells):
        max_c *= 2  # Poisson arrivals can pile up past the closed loop's peak
    tag = f"-r{rnd + 1}" if args.rounds > 1 else ""
    port = free_port()
    log = out / "logs" / f"{setup.name}-{arm}{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    trace = (str((out / "logs" / f"{setup.name}-{arm}{tag}-trace.jsonl").resolve())
             if args.trace and arm.startswith("adaptive") else None)
    argv_s, env = server_command(setup, arm, target, draft, port, max_c, trace)
    server = Server(argv_s, {**base_env, **env}, log, port)
    try:
        try:
            ready = server.wait_ready()
        except RuntimeError as e:
            # One arm that cannot start does not cost the rest of the grid.
            failures.append(dict(setup=setup.name, arm=arm, cell=None, error=str(e)))
            print(f"[served] FAILED to start {setup.name} {arm}: {e}", file=sys.stderr)
            progress.advance(setup.ready_s + sum(cell_units(setup, c) for c in cells),
                             f"{setup.name} {arm}: failed to start")
            return
        info = dict(setup=setup.name, arm=arm, round=rnd + 1, ready_s=round(ready, 1),
                    kv_tokens=server.kv_tokens(),
                    rss_ready_gib=round(resident_gib(server.proc.pid), 2))
        progress.advance(setup.ready_s, f"{setup.name} {arm}: ready in {ready:.0f} s, "
                         f"KV {info['kv_tokens']} tokens")
        for cell in cells:
            t = time.time()
            try:
                rec = run_cell(server, cell, setup, target, out, arm, rnd + 1)
            except RuntimeError as e:
                failures.append(dict(setup=setup.name, arm=arm, cell=cell.key,
                                     error=str(e)))
                print(f"[served] FAILED {setup.name} {arm} {cell.key}: {e}",
                      file=sys.stderr)
                rec = None
            if rec is not None:
                runs.append(rec)
            progress.advance(cell_units(setup, cell), f"{setup.name} {arm} {cell.key}: "
                             + (f"{rec.get('output_throughput', 0):.2f} tok/s"
                                if rec else "FAILED") + f" ({time.time() - t:.0f} s)")
        info["rss_peak_gib"] = round(resident_gib(server.proc.pid, "VmHWM"), 2)
        servers.append(info)
    finally:
        server.stop()


def _report(argv, args, out: Path, plan, started: float, runs, servers, failures) -> int:
    """The run's results and report written; the exit status (1: a float32 mismatch or a
    failed run)."""
    from vllm_specplug import compat
    from vllm_specplug.profiling import cpu_model
    from vllm_specplug.tools.bench import served_report

    meta = dict(
        command="python -m vllm_specplug.tools.bench " + " ".join(argv),
        commit=commit(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_minutes=round((time.time() - started) / 60, 1),
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}, "
                f"{platform.platform()}",
        vllm=compat.vllm_version(), setups={s.name: s.title for s, *_ in plan},
        dtype={s.name: s.dtype or "the model's (bfloat16)" for s, *_ in plan},
        output_tokens={s.name: s.output_tokens for s, *_ in plan}, rounds=args.rounds,
    )
    results = served_report.summarise(runs, servers, meta, failures)
    served_report.write(results, out)
    print(served_report.markdown(results))
    blamed = [m for m in results["mismatches"] if not m["explained"]]
    # Exactness is promised where verification is exact: in float32.  In
    # bfloat16 a K+1-token pass can round a near-tie differently from a
    # one-token step, and other draft lengths flip other near-ties.
    exact = {s.name for s, *_ in plan if s.dtype == "float32"}
    failing = [m for m in blamed if m["setup"] in exact]
    if failing:
        print(f"[served] {len(failing)} greedy mismatch(es) in float32 that vLLM's static K does "
              f"not share: see {out / 'results.md'}", file=sys.stderr)
    if len(blamed) > len(failing):
        print(f"[served] note: {len(blamed) - len(failing)} greedy mismatch(es) in bfloat16 that "
              f"no static arm shares (verification numerics of other draft lengths; exactness "
              f"is checked in float32): see {out / 'results.md'}", file=sys.stderr)
    if failures:
        print(f"[served] {len(failures)} failed run(s) or server start(s): see "
              f"{out / 'results.md'}", file=sys.stderr)
    return 1 if failing or failures else 0


def _finished(src: Path, flag: str) -> tuple[dict, list[dict]]:
    """A finished run's results.json, and its runs round by round with vLLM's per-request results."""
    path = src / "results.json"
    if not path.is_file():
        raise SystemExit(f"{flag}: no results.json in {src}")
    res = json.loads(path.read_text())
    runs = []
    for r in res.get("runs_by_round") or res["runs"]:
        key = Cell(r["workload"], r["kind"], r["concurrency"], 0, "", False, False).key
        raw = raw_path(src, r["setup"], r["arm"], key, r.get("round") or 1)
        if not raw.is_file():
            raise SystemExit(f"{flag}: {raw} is missing")
        runs.append(dict(r, **per_request(json.loads(raw.read_text()))))
    return res, runs


def render(out: Path) -> int:
    """The report of a finished run, again: from its results.json and vLLM's raw results."""
    from vllm_specplug.tools.bench import served_report

    path = out / "results.json"
    sources = (json.loads(path.read_text())["meta"].get("sources")
               if path.is_file() else None)
    if sources:  # a pooled report: pool its sources again
        return pool([Path(s) for s in sources], out)
    res, runs = _finished(out, "--render")
    res = served_report.summarise(runs, res["servers"], res["meta"], res.get("failures"))
    served_report.write(res, out)
    print(served_report.markdown(res))
    return 0


def pool(sources: list[Path], out: Path) -> int:
    """One report over the rounds of several finished runs of the same grid.

    Rounds are numbered on (the second run's first round follows the first
    run's last), so a cell pools all of them and its confidence interval
    counts every round.  The runs must share setups, workloads, loads, arms,
    output length and dtype; which commits they measured is theirs to say
    (``meta["commit"]`` lists each).
    """
    from vllm_specplug.tools.bench import served_report

    runs, servers, failures, metas, grids = [], [], [], [], []
    offset = 0
    for src in sources:
        res, rs = _finished(src, "--pool")
        m = res["meta"]
        grids.append((json.dumps({k: m.get(k) for k in ("setups", "output_tokens", "dtype")},
                                 sort_keys=True),
                      sorted({(r["setup"], r["workload"], r["kind"], r["concurrency"], r["arm"])
                              for r in rs})))
        runs += [dict(r, round=(r.get("round") or 1) + offset) for r in rs]
        servers += [dict(x, round=(x.get("round") or 1) + offset) for x in res["servers"]]
        failures += res.get("failures") or []
        metas.append(m)
        offset += int(m.get("rounds") or 1)
    if any(g != grids[0] for g in grids):
        raise SystemExit("--pool: the runs are not of one grid (setups, workloads, loads, arms, "
                         "output tokens and dtype must match)")
    meta = dict(metas[-1], rounds=offset, sources=[str(s) for s in sources],
                command=" + ".join(m["command"] for m in metas),
                commit=", ".join(dict.fromkeys(m["commit"] for m in metas)),
                date=", ".join(m["date"] for m in metas),
                wall_minutes=round(sum(m["wall_minutes"] for m in metas), 1))
    res = served_report.summarise(runs, servers, meta, failures)
    out.mkdir(parents=True, exist_ok=True)
    served_report.write(res, out)
    print(served_report.markdown(res))
    return 0


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
