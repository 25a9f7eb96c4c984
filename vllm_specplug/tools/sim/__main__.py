"""python -m vllm_specplug.tools.sim: sweep policies x scenarios x concurrency.

    python -m vllm_specplug.tools.sim --gpu h200 --out benchmarks/sim_results
    python -m vllm_specplug.tools.sim --quick
    python -m vllm_specplug.tools.sim --setup 70b-1b --scenarios trace:run.jsonl --concurrency 8,64
    python -m vllm_specplug.tools.sim --record-trace run.jsonl --setup 70b-1b --scenarios switch \\
        --concurrency 8

Writes results.json, results.md and one PNG per setup under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_specplug.tools.sim.cost import SETUP_KEYS
from vllm_specplug.tools.sim.devices import DEVICES
from vllm_specplug.tools.sim.cell import CellSpec
from vllm_specplug.tools.sim.policies import POLICIES
from vllm_specplug.tools.sim.run import record_trace
from vllm_specplug.tools.sim.provenance import controller_sha, git_rev, meta_for
from vllm_specplug.tools.sim.report import write_outputs
from vllm_specplug.tools.sim.scenarios import PARAMETRIC, make_scenario
from vllm_specplug.tools.sim.sweep import cell_specs, run_sweep
from vllm_specplug.tools.sim.trace import write_trace
from vllm_specplug.tools.sweeps import RayUnavailable

FULL_CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("values must be integers >= 1")
    return sorted(set(vals))


def _names(known, what):
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        for v in vals:
            if v not in known and not (what == "scenario" and v.startswith("trace:")):
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {v!r}; known: {', '.join(known)}"
                    + (", trace:PATH" if what == "scenario" else ""))
        return vals
    return parse


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m vllm_specplug.tools.sim",
                                description=__doc__.split("\n\n")[0])
    gpus = [k for k in DEVICES if k != "cpu"]
    p.add_argument("--gpu", choices=gpus, default="h200",
                   help="device of the GPU setups: h200 = passes measured on an H200; "
                        "h200-roofline and h100 = the roofline")
    p.add_argument("--setup", type=_names(SETUP_KEYS, "setup"), default=list(SETUP_KEYS),
                   help="comma list of " + ", ".join(SETUP_KEYS))
    p.add_argument("--scenarios", type=_names(PARAMETRIC, "scenario"),
                   default=list(PARAMETRIC), help="comma list of "
                   + ", ".join(PARAMETRIC) + " or trace:PATH")
    p.add_argument("--policies", type=_names(POLICIES, "policy"), default=list(POLICIES))
    p.add_argument("--concurrency", type=_ints, default=FULL_CONCURRENCY,
                   help="comma list (cpu-qwen is capped at 16)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=0.5,
                   help="request generations (x concurrency completions) before measuring")
    p.add_argument("--measure", type=float, default=1.0,
                   help="request generations measured (at least --min-window completions)")
    p.add_argument("--min-window", type=int, default=16,
                   help="completions measured, at least (low concurrency)")
    p.add_argument("--noise", type=float, default=None,
                   help="lognormal sigma of step times (default per setup: GPU 0.05, CPU 0.10)")
    p.add_argument("--cold-steps", type=int, default=2,
                   help="slow (3x) first steps of each step shape an engine has not run")
    p.add_argument("--ideal-clock", action="store_true",
                   help="no cold first steps and no stalls (the noise stays)")
    p.add_argument("--zero-cost-fallback", action="store_true",
                   help="no draft work at K_step=0 (default: vLLM today, first pass still runs)")
    p.add_argument("--decode-only", action="store_true",
                   help="prompts arrive already cached: no prefill chunks in steps")
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="Poisson arrivals (requests/s) into at most --concurrency slots "
                        "(default: closed loop at fixed concurrency)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallelism of GPU setups")
    p.add_argument("--out", type=Path, default=Path("benchmarks/sim_results"))
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (with --ray: CPUs of the local Ray cluster)")
    p.add_argument("--ray", action="store_true",
                   help="run the cells as Ray tasks on a local Ray cluster started for the run")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="run the cells as Ray tasks on this running cluster ('auto': the "
                        "one `ray start` made on this node); implies --ray")
    p.add_argument("--quick", action="store_true",
                   help="small sweep: 70b-1b and 8b-eagle, c in 1,8,64,512, 1 seed, "
                        "half a generation measured")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-calibration", action="store_true",
                   help="skip the CPU calibration table (run when cpu-qwen is in --setup)")
    p.add_argument("--record-trace", type=Path, default=None, metavar="PATH",
                   help="run static K=8 for the first setup/scenario/concurrency and write "
                        "its acceptance trace (JSONL) to PATH, then exit")
    p.add_argument("--render", type=Path, default=None, metavar="RESULTS_JSON",
                   help="re-render results.md and the PNGs from an existing results.json "
                        "(into --out) without running anything")
    a = p.parse_args(argv)

    if a.render is not None:
        old = json.loads(a.render.read_text())
        meta, cells = old["meta"], old["cells"]
        first = cells[0]
        opts = {k: first[k] for k in ("gpu", "draft_at_k0", "tp")}
        setups = list(dict.fromkeys(c["setup"] for c in cells))
        doc = write_outputs(a.out, meta, opts, cells, setups, old.get("calibration"),
                            plots=not a.no_plots)
        print(f"[sim] re-rendered {a.out}/results.md"
              + (f", {', '.join(doc['plots'])}" if doc["plots"] else ""))
        return 0

    if a.quick:
        if "--setup" not in " ".join(argv):
            a.setup = ["70b-1b", "8b-eagle"]
        if "--concurrency" not in " ".join(argv):
            a.concurrency = [1, 8, 64, 512]
        if "--seeds" not in " ".join(argv):
            a.seeds = 1
        if "--measure" not in " ".join(argv):
            a.measure = 0.5
        if "--min-window" not in " ".join(argv):
            a.min_window = 4
    for s in a.scenarios:
        make_scenario(s)  # fail early on a bad trace path
    opts = dict(gpu=a.gpu, draft_at_k0=not a.zero_cost_fallback, warmup=a.warmup,
                measure=a.measure, min_window=a.min_window, noise=a.noise,
                arrival_rate=a.arrival_rate,
                tp=a.tp, prefill=not a.decode_only, realism=not a.ideal_clock,
                cold_steps=a.cold_steps)

    if a.record_trace is not None:
        spec = CellSpec(a.setup[0], a.scenarios[0], "static-8", a.concurrency[0], 0, **opts)
        result, trace = record_trace(spec)
        write_trace(a.record_trace, trace)
        n = sum(len(r.records) for r in trace.requests)
        print(f"wrote {a.record_trace}: {len(trace.requests)} requests, {n} verifications "
              f"({spec.key()}, goodput {result['goodput']:.1f} tok/s)")
        return 0

    t0 = time.time()
    sha_start, git_start = controller_sha(), git_rev()
    ray_address = a.ray_address or ("local" if a.ray else None)
    specs = cell_specs(a.setup, a.scenarios, a.policies, a.concurrency, a.seeds, **opts)
    print(f"[sim] {len(specs)} cells: setups {','.join(a.setup)} on {a.gpu}, scenarios "
          f"{','.join(a.scenarios)}, concurrency {','.join(map(str, a.concurrency))}, "
          f"{a.seeds} seed(s), "
          + (f"Ray tasks ({ray_address})" if ray_address else f"{a.jobs} job(s)"),
          file=sys.stderr)
    try:
        results = run_sweep(specs, jobs=a.jobs, ray_address=ray_address)
    except RayUnavailable as exc:
        print(f"[sim] {exc}", file=sys.stderr)
        return 2
    calibration = None
    if "cpu-qwen" in a.setup and not a.no_calibration:
        from vllm_specplug.tools.sim.calibration import calibration_report

        calibration = calibration_report()
    meta = meta_for(argv, {"seeds": a.seeds, "warmup": a.warmup, "measure": a.measure,
                           "min_window": a.min_window,
                           "gpu": a.gpu, "draft_at_k0": not a.zero_cost_fallback,
                           "prefill": not a.decode_only, "arrival_rate": a.arrival_rate,
                           "realism": not a.ideal_clock, "cold_steps": a.cold_steps},
                    time.time() - t0)
    meta["controller_sha"], meta["git"] = sha_start, git_start
    if controller_sha() != sha_start:
        # Workers fork from this process, which imported the controller at
        # the start: every cell ran the code recorded here.
        meta["warning"] = ("the controller's files changed while the sweep ran; every cell "
                           "ran the code loaded at the start (this sha)")
        print(f"[sim] note: {meta['warning']}", file=sys.stderr)
    doc = write_outputs(a.out, meta, opts, results, a.setup, calibration,
                        plots=not a.no_plots)
    meta["runtime_s"] = time.time() - t0
    rows = [r for r in doc["summary"]["rows"] if "goodput_vs_ref" in r]
    bad = [r for r in rows if not r["ok"]]
    print(f"[sim] wrote {a.out}/results.md, results.json"
          + (f", {', '.join(doc['plots'])}" if doc["plots"] else "")
          + f" in {meta['runtime_s']:.0f}s")
    print(f"[sim] goodput >= 0.97 x max(plain, best static) in {len(rows) - len(bad)}/{len(rows)} "
          "cells" + (":" if bad else ""))
    for r in bad:
        print(f"    {r['setup']}/{r['scenario']}/c={r['concurrency']}: "
              f"{r['goodput_vs_ref']:.3f} (goodput {r['goodput']:.0f}, plain {r['plain']:.0f}, "
              f"best static K={r['best_static_k']} {r['best_static']:.0f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
