"""Benchmark: plain vs static K vs vLLM's batch-size table vs adaptive K.

    python -m vllm_specplug.tools.bench --quick          # ~10 min: Qwen pair, easy + hard, c=1
    python -m vllm_specplug.tools.bench                  # the full grid (says how long up front)
    python -m vllm_specplug.tools.bench --setups smollm-ngram --workloads mixed --concurrency 1,4
    python -m vllm_specplug.tools.bench --served [--quick]  # real servers, vLLM's own client (bench/served.py)
    python -m vllm_specplug.tools.bench --ab                # every arm on one server, interleaved (bench/ab.py)

Every speculative policy's greedy output is compared with plain decoding;
any mismatch is reported loudly.  The exit status is 1 unless every
mismatching request of an adaptive policy diverged under a static K too, in
the same cell and repeat: that is verification's numerics (in bfloat16 on an
AVX-512-BF16 CPU, vLLM's own static K diverges from plain decoding at near
ties), which the plugin inherits and does not change.  Writes
``results.json``, ``results.md`` and PNG plots to ``--out``.  See
benchmarks/README.md for the schema and the recorded results.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from vllm_specplug.tools.bench import report
from vllm_specplug.tools.bench.runner import (Progress, RunResult, configure_policy, env_defaults,
                                        run_cell, start_engine, stop_engine)
from vllm_specplug.tools.bench.setups import POLICIES, SETUPS, load_prompts, policy_names

# Four interleaved repeats: one run's tok/s moves by up to a third with the
# host, and with a median of two the goodput / best-static ratio on code
# read 0.94 and 1.01 in two runs that drafted and accepted the same tokens.
QUICK = dict(setups=["qwen"], workloads=["code_completion", "prose"], concurrency=[1],
             policies=["plain", "static", "goodput", "goodput-no-zcf"], repeats=4,
             requests=2, max_tokens=32, static_ks=(2, 4))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m vllm_specplug.tools.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="Qwen pair, code completion + prose, concurrency 1 (~10 min)")
    p.add_argument("--setups", default="qwen,smollm-ngram",
                   help=f"comma-separated: {', '.join(SETUPS)}")
    p.add_argument("--workloads", default=None,
                   help="comma-separated workload names (prompt files in benchmarks/prompts)")
    p.add_argument("--prompts", default=None,
                   help="your own JSON-lines prompt file (replaces --workloads)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts")
    p.add_argument("--policies", default="plain,static,vllm-table,heuristic,goodput,goodput-no-zcf",
                   help=f"comma-separated: {', '.join(POLICIES)} (static expands to each K)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repetitions per cell")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: every prompt of the workload)")
    p.add_argument("--max-tokens", type=int, default=None, help="override max tokens per request")
    p.add_argument("--out", default="bench-results", help="output folder")
    p.add_argument("--ray", action="store_true",
                   help="run each setup as a Ray task on a local Ray cluster started for the run")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="run each setup as a Ray task on this running cluster ('auto': the one "
                        "`ray start` made on this node)")
    p.add_argument("--ray-cpus-per-setup", type=int, default=None,
                   help="CPUs each setup's task holds on a CPU cluster (default: all of this "
                        "machine's); on GPUs each task holds one GPU")
    p.add_argument("--tiny-root", default="/tmp/vllm-specplug-bench-tiny",
                   help="where the tiny smoke-test models are made")
    args = p.parse_args(argv)
    if args.quick:
        args.setups = ",".join(QUICK["setups"])
        args.workloads = ",".join(QUICK["workloads"])
        args.concurrency = ",".join(map(str, QUICK["concurrency"]))
        args.policies = ",".join(QUICK["policies"])
        args.repeats = QUICK["repeats"]
        args.requests = args.requests or QUICK["requests"]
        args.max_tokens = args.max_tokens or QUICK["max_tokens"]
    return args


def mark_static_k_mismatches(mismatches: list[dict]) -> None:
    """Set ``also_under_static_k`` on every mismatch.

    True for a static K's own mismatch (verification at a fixed K, what vLLM
    does without the plugin), and for an adaptive policy's whose requests all
    diverged under a static K in the same setup, workload, concurrency and
    repeat: the adaptive policies change which drafts are offered, never how
    they are verified, so such a request points at verification's numerics.
    False for everything else, ``k0`` and the plain engine included (no
    verification at all there): those fail the run.
    """
    static_bad: dict[tuple, set] = {}
    for m in mismatches:
        if m["policy"].startswith("static-K"):
            key = (m["setup"], m["workload"], m["concurrency"], m["rep"])
            static_bad.setdefault(key, set()).update(m.get("requests", []))
    for m in mismatches:
        if m["policy"].startswith("static-K"):
            m["also_under_static_k"] = True
        elif m["policy"] in ("k0", "plain") or not m.get("requests"):
            m["also_under_static_k"] = False
        else:
            seen = static_bad.get((m["setup"], m["workload"], m["concurrency"], m["rep"]), set())
            m["also_under_static_k"] = set(m["requests"]) <= seen


def main(argv: list[str] | None = None) -> int:
    if "--ab" in (sys.argv[1:] if argv is None else argv):
        from vllm_specplug.tools.bench.ab import main as ab_main

        return ab_main(argv)
    if "--served" in (sys.argv[1:] if argv is None else argv):
        from vllm_specplug.tools.bench.served import main as served_main

        return served_main(argv)
    args = parse_args(argv)
    env_defaults()
    setups = [SETUPS[s] for s in args.setups.split(",") if s]
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    wanted = [p for p in args.policies.split(",") if p]
    unknown = [p for p in wanted if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {sorted(POLICIES)}")

    plan = []  # (setup, workload, prompts, policies)
    for setup in setups:
        if args.prompts:
            names = [("custom", args.prompts)]
        else:
            names = [(w, None) for w in (args.workloads.split(",") if args.workloads
                                           else setup.workloads)]
        policies = policy_names(setup, wanted)
        if args.quick:
            policies = [p for p in policies if not p.startswith("static-K")
                        or int(p[len("static-K"):]) in QUICK["static_ks"]]
        for workload, path in names:
            prompts = load_prompts(setup, workload, path)
            if args.max_tokens:
                prompts = [(p, args.max_tokens) for p, _ in prompts]
            if args.requests:
                prompts = prompts[: args.requests]
            plan.append((setup, workload, prompts, policies))

    # The plain engine runs before and after the speculative one (once,
    # after it, in quick mode).
    plain_runs = 1 if args.quick else 2
    total = _work_units(plan, concurrency, args.repeats, plain_runs)
    n_runs = sum(len(concurrency) * (len([p for p in pol if p != "plain"]) * args.repeats
                                     + (plain_runs if "plain" in pol else 0))
                 for _, _, _, pol in plan)
    print(f"[bench] {n_runs} runs over {len(plan)} (setup, workload) pairs x {len(concurrency)} "
          f"load levels; rough estimate {total / 60:.0f} min plus ~1 min per engine start "
          f"({2 * len(setups) + (len(setups) if 'plain' in wanted else 0)} starts). "
          "Progress and time left follow on stderr.", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    jobs = [(setup, [x for x in plan if x[0] is setup]) for setup in setups]
    if args.ray or args.ray_address:
        from vllm_specplug.tools.sweeps import RayUnavailable, ray_map

        # One Ray task per setup: each starts its own engines and holds the
        # CPUs (or GPU) of one node while it runs, so setups never share a
        # machine and their numbers stay comparable.
        resources = ({"num_gpus": 1} if _has_cuda() else
                     {"num_cpus": args.ray_cpus_per_setup or _cpus()})
        print(f"[bench] {len(jobs)} setup(s) as Ray tasks ({args.ray_address or 'local'}; "
              f"{resources} each); each task prints its own progress", flush=True)
        try:
            parts = ray_map(_SetupJob(concurrency, args, str(out.resolve()), plain_runs), jobs,
                            address=args.ray_address, resources=resources)
        except RayUnavailable as exc:
            print(f"[bench] {exc}", file=sys.stderr)
            return 2
    else:
        progress = Progress(total, "bench")
        job = _SetupJob(concurrency, args, str(out), plain_runs, progress)
        parts = [job(j) for j in jobs]
    runs = [r for part in parts for r in part["runs"]]
    mismatches = [m for part in parts for m in part["mismatches"]]
    traces = {k: v for part in parts for k, v in part["traces"].items()}
    for part in parts:
        for name, text in part["trace_texts"].items():
            Path(traces[name]).write_text(text)
    compared = any(part["compared"] for part in parts)
    meta = dict(
        command="python -m vllm_specplug.tools.bench " + " ".join(argv if argv is not None
                                                             else sys.argv[1:]),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_minutes=round((time.time() - started) / 60, 1),
        machine=f"{platform.machine()}, {_cpus()} CPUs, {platform.platform()}",
        vllm=_vllm_version(),
        setups={s.name: s.title for s in setups},
        concurrency=concurrency,
        repeats=args.repeats,
    )
    mark_static_k_mismatches(mismatches)
    results = report.summarise(runs, meta, mismatches)
    report.write(results, out, traces)
    print(report.markdown(results))
    if mismatches:
        blamed = [m for m in mismatches if not m.get("also_under_static_k")]
        if blamed:
            for m in blamed:
                print(f"[bench] MISMATCH: {m['setup']} {m['workload']} c={m['concurrency']} "
                      f"{m['policy']} rep {m['rep']}: greedy output differs from plain decoding "
                      f"in requests {m.get('requests')}", file=sys.stderr)
            print(f"[bench] {len(blamed)} mismatch(es) not explained by vLLM's own static K: "
                  f"see {out / 'results.json'}", file=sys.stderr)
            return 1
        print(numerics_note(mismatches, setups), file=sys.stderr)
        return 0
    if compared:
        print(f"[bench] greedy outputs of every policy equal plain decoding. Results in {out}/")
    else:
        print(f"[bench] no plain-engine run: outputs were not compared. Results in {out}/")
    return 0


def numerics_note(mismatches: list[dict], setups) -> str:
    """One paragraph on greedy outputs that differ only where vLLM's static K differs too."""
    dtypes = {s.name: s.engine_extra.get("dtype", "bfloat16") for s in setups}
    cells: dict[tuple, set] = {}
    for m in mismatches:
        key = (m["setup"], m["workload"], m["concurrency"])
        cells.setdefault(key, set()).add(m["policy"])
    where = "; ".join(f"{s} {w} c={c}: {', '.join(sorted(p))}" for (s, w, c), p in
                      sorted(cells.items()))
    kinds = sorted({dtypes.get(s, "bfloat16") for s, _, _ in cells})
    return (f"[bench] Note: {len(mismatches)} greedy output(s) differ from plain decoding "
            f"({where}). Expected, not a bug: each is vLLM's own static K's, or a request that "
            f"vLLM's static K also changed in the same cell and repeat. In {'/'.join(kinds)}, "
            f"verifying K+1 tokens in one pass rounds differently from a one-token step, and "
            f"a near-tie can then pick another token; the plugin changes which drafts are "
            f"offered, never how they are verified. In float32 this is much rarer. Details in "
            f"results.json (\"mismatches\").")


class _SetupJob:
    """Everything for one setup: its plain engine (before and after), its
    speculative engine with every policy interleaved, and the output checks
    against plain decoding.  A callable object so that it runs the same in
    this process and as a Ray task (``--ray``)."""

    def __init__(self, concurrency, args, out, plain_runs, progress=None) -> None:
        self.concurrency, self.args, self.out = concurrency, args, out
        self.plain_runs, self.progress = plain_runs, progress

    def __call__(self, job) -> dict:
        setup, items = job
        args, concurrency, plain_runs = self.args, self.concurrency, self.plain_runs
        out = Path(self.out)
        env_defaults()
        progress = self.progress
        remote = progress is None
        if remote:  # a Ray task: its own bar over this setup's work
            progress = Progress(_work_units(items, concurrency, args.repeats, plain_runs),
                                f"bench {setup.name}")
        runs: list[RunResult] = []
        plain_outputs: dict[tuple, list] = {}
        mismatches: list[dict] = []
        traces: dict[str, str] = {}
        unchecked: list[tuple] = []  # speculative outputs that ran before their plain reference

        def check_outputs(key, outs) -> None:
            s_name, workload, c, policy, rep = key
            ref = plain_outputs.get((s_name, workload))
            if ref is None or outs == ref:
                return
            bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
            # Reported once, explained, at the end (numerics_note).
            mismatches.append(dict(setup=s_name, workload=workload, concurrency=c,
                                   policy=policy, rep=rep, requests=bad))

        max_c = max(concurrency)
        policies_all = items[0][3] if items else []
        spec_policies = [p for p in policies_all if p != "plain"]

        def plain_pass(rep):
            llm = start_engine(setup, False, max_c, args.tiny_root)
            try:
                for _, workload, prompts, _ in items:
                    for c in concurrency:
                        r = run_cell(llm, prompts, c, speculative=False)
                        runs.append(_result(setup, workload, c, "plain", rep, r))
                        plain_outputs.setdefault((setup.name, workload), r["outputs"])
                        if r["outputs"] != plain_outputs[(setup.name, workload)]:
                            mismatches.append(dict(setup=setup.name, workload=workload,
                                                   concurrency=c, policy="plain", rep=rep,
                                                   note="plain differs from its own first run"))
                        progress.advance(_units(setup, prompts),
                                         f"{setup.name} {workload} c={c} plain "
                                         f"{r['tok_s']:.2f} tok/s")
            finally:
                stop_engine(llm)

        if "plain" in policies_all and plain_runs == 2:
            plain_pass(0)
        if spec_policies:
            llm = start_engine(setup, True, max_c, args.tiny_root)
            try:
                for _, workload, prompts, _ in items:
                    for c in concurrency:
                        for rep in range(args.repeats):
                            for policy in spec_policies:
                                trace = None
                                if (policy == "goodput" and workload == "mixed" and rep == 0
                                        and c == max_c):
                                    trace = str(out / f"trace-{setup.name}-mixed-c{c}.jsonl")
                                    Path(trace).unlink(missing_ok=True)
                                    traces[setup.name] = trace
                                configure_policy(llm, setup, policy, trace, workload)
                                r = run_cell(llm, prompts, c, speculative=True)
                                if trace:  # closes it
                                    configure_policy(llm, setup, policy, None, workload)
                                runs.append(_result(setup, workload, c, policy, rep, r))
                                key = (setup.name, workload, c, policy, rep)
                                if (setup.name, workload) in plain_outputs:
                                    check_outputs(key, r["outputs"])
                                else:  # plain runs after the speculative engine
                                    unchecked.append((key, r["outputs"]))
                                progress.advance(_units(setup, prompts),
                                                 f"{setup.name} {workload} c={c} {policy} "
                                                 f"rep {rep + 1}: {r['tok_s']:.2f} tok/s")
            finally:
                stop_engine(llm)
        if "plain" in policies_all:
            plain_pass(1)

        for key, outs in unchecked:
            check_outputs(key, outs)
        # A Ray task may run on another node: send the trace itself back.
        texts = {name: Path(path).read_text() for name, path in traces.items()} if remote else {}
        return dict(runs=runs, mismatches=mismatches, traces=traces, trace_texts=texts,
                    compared=bool(plain_outputs))


def _units(setup, prompts) -> float:
    # Work in "nominal seconds": output tokens / the setup's nominal rate.
    return sum(m for _, m in prompts) / setup.nominal_tok_s


def _work_units(plan, concurrency, repeats, plain_runs) -> float:
    total = 0.0
    for setup, _, prompts, policies in plan:
        n_spec = len([p for p in policies if p != "plain"])
        n_plain = plain_runs if "plain" in policies else 0
        total += _units(setup, prompts) * len(concurrency) * (n_spec * repeats + n_plain)
    return total


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _result(setup, workload, c, policy, rep, r) -> RunResult:
    return RunResult(setup=setup.name, workload=workload, concurrency=c, policy=policy, rep=rep,
                     **{k: r[k] for k in ("tok_s", "wall_s", "output_tokens", "tpot_mean_s",
                                          "tpot_p90_s", "accepted_len", "drafted_per_step",
                                          "fallback_frac", "engine_steps")})


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _vllm_version() -> str:
    from vllm_specplug import compat

    return compat.vllm_version()


if __name__ == "__main__":
    from vllm_specplug.tools.bench import exit_quietly

    exit_quietly(main())
