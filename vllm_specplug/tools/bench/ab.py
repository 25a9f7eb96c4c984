"""Interleaved A/B: every arm on one plugin server, wave by wave, paired.

    python -m vllm_specplug.tools.bench --ab                     # both setups, the whole grid
    python -m vllm_specplug.tools.bench --ab --setups qwen --workloads humaneval --concurrency 1

Arms on separate servers minutes apart cannot be compared to a few percent
on a machine whose speed drifts (this one moved 1.3-1.6x within a run).
Here one ``vllm-specplug serve`` (the adaptive configuration, the shipped
ceiling) serves every arm, chosen per request through ``vllm_xargs``:

- ``plain``: ``specplug_k: 0``, no drafts (the plugin's zero-cost fallback
  where it applies: the draft model does not run);
- ``k2``, ``k4``, ... : ``specplug_k: N``, exactly N drafts a step (vLLM's
  static K, on the plugin's server);
- ``adaptive``: nothing set, the plugin's choice.

A cell (workload, concurrency c) is ``waves`` waves of c prompts; every arm
sends a wave's same prompts with ``vllm bench serve`` (vLLM's own client,
``--extra-body`` carrying the arm's ``vllm_xargs``), one arm after another,
in an order that changes from wave to wave (``wave_orders``: every arm
at every place in the order, and after every other arm, equally often),
so neither a drift of the host nor what an arm leaves behind for the
next falls on one arm more than another.  Per arm: output tokens/s (tokens over the waves' summed
durations), TTFT and TPOT; per cell, the ratio adaptive / each arm with a
bootstrap 90% interval over waves (waves resampled, each arm's rate pooled
over the resample).  The grid's first cell runs again at the end: how far
its ratio moves is the instrument's repeatability.  Prefix caching is off on
the server, so that a prompt's later arms do not find the prefill an earlier
arm left (all arms pay it alike).  What the A/B cannot show, the separate
server arms do (``--served``): vLLM without the plugin, and the memory each
arm takes.  The server's learning is shared: step costs and acceptance
observed under one arm inform the adaptive choice in the next wave, as
mixed traffic would on a real server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_specplug.tools.bench import served
from vllm_specplug.tools.bench.ab_report import mark_drafting, markdown, summarise, write
from vllm_specplug.tools.bench.server import (Server, free_port, resident_gib, server_command,
                                              server_env)
from vllm_specplug.tools.bench.served_client import KEEP, client_args, per_request, vllm_bench_serve
from vllm_specplug.tools.bench.served_grid import Cell, cell_units, prompt_sources, setup_models
from vllm_specplug.tools.bench.runner import Progress

# The fixed k of each setup's arms (besides plain and adaptive).
FIXED_K = {"qwen": (2, 4, 8), "smollm-ngram": (2, 4, 6), "tiny": (2,)}
# The grid: 1, 4 and 8 requests for both real setups.
CONCURRENCY = {"qwen": (1, 4, 8), "smollm-ngram": (1, 4, 8), "tiny": (1, 2)}
# Waves per cell by concurrency (default 2): a one-request wave is one prompt, and
# a cell's ratio swings with the prompt, so c=1 takes more of them; at 4 and 8
# requests a wave is one batch, and two waves of one arm measured up to 19% apart
# (the plain arm, Qwen ShareGPT c=8, grid at e20e290), so those cells take 4.
WAVES = {1: 6, 4: 4, 8: 4}


def wave_orders(n: int) -> list[list[int]]:
    """The orders of ``n`` arms the waves take in turn: a Williams design.

    Each order is followed by its reverse, so over any two waves in a row
    every arm's mean place is the middle one, and over the whole cycle
    (``2 n`` orders) every arm follows every other exactly twice, in first
    place as often as in last.  A rotation of one order (arm ``i`` at place
    ``i + wave``) always puts the same arm before each: in the grid at
    ``6ad0efa`` the adaptive arm always ran right after ``k8``, and where it
    decoded exactly as plain it measured 0.972x plain's rate (16 waves)."""
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    orders = []
    for i in range(n):
        row = [(a + i) % n for a in first]
        orders += [row, row[::-1]]
    return orders


def arms_of(setup: str) -> list[tuple[str, int | None]]:
    return ([("plain", 0)] + [(f"k{k}", k) for k in FIXED_K.get(setup, (2, 4))]
            + [("adaptive", None)])


@dataclass
class Wave:
    workload: str
    concurrency: int
    index: int  # the wave's number in its cell
    path: str  # its c prompts
    chat: bool
    structured: bool
    repeat: bool = False

    @property
    def cell(self) -> str:
        return f"{self.workload}/c{self.concurrency}" + ("/repeat" if self.repeat else "")


def build_waves(setup, workloads, concurrency, waves_of, out: Path, tokenizer,
                data_cache=None) -> list[list[Wave]]:
    """Cells, each a list of waves with prompts of their own (no cell reuses another's)."""
    cells = []
    for w in workloads:
        prompts, is_chat = prompt_sources(setup, w, tokenizer, data_cache)
        at = 1  # prompt 0 warms the server up
        for c in concurrency:
            cell = []
            for i in range(waves_of(c)):
                if at + c > len(prompts):
                    raise SystemExit(f"{setup.name} {w}: {len(prompts)} prompts fit, "
                                     f"the grid needs more")
                path = out / "workloads" / setup.name / f"{w}-c{c}-w{i}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(json.dumps({"prompt": p, "output_tokens":
                                                    setup.output_tokens}) + "\n"
                                        for p in prompts[at:at + c]))
                at += c
                cell.append(Wave(w, c, i, str(path), is_chat, w == "json"))
            cells.append(cell)
    cells.append([Wave(**{**x.__dict__, "repeat": True}) for x in cells[0]])
    return cells


def _with_xargs(argv: list[str], k: int | None) -> list[str]:
    """``vllm bench serve`` arguments with the arm's ``vllm_xargs`` in ``--extra-body``."""
    argv = list(argv)
    body = {}
    if "--extra-body" in argv:
        i = argv.index("--extra-body")
        body = json.loads(argv[i + 1])
        del argv[i:i + 2]
    if k is not None:
        body["vllm_xargs"] = {"specplug_k": k}
    return argv + (["--extra-body", json.dumps(body)] if body else [])


class Client:
    """``vllm bench serve`` runs, each in a child process forked from this one.

    Run in this process, every run kept about 100 MB (a grid of 140 waves
    held 13 GB and the machine stalled); a child keeps what its runs leave
    and is replaced after ``RUNS_PER_CHILD`` of them.  vLLM's client is
    imported here first, so a new child starts in a moment."""

    RUNS_PER_CHILD = 8

    def __init__(self) -> None:
        from vllm_specplug.tools.serve import install_version_shim

        install_version_shim()
        import vllm.benchmarks.serve  # noqa: F401  (inherited by every child)

        self._pool, self._runs = None, 0

    def run(self, argv: list[str], log: Path) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if self._pool is None or self._runs >= self.RUNS_PER_CHILD:
            self.close()
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("fork"))
            self._runs = 0
        self._runs += 1
        self._pool.submit(vllm_bench_serve, argv, log).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def raw_name(workload: str, concurrency: int, repeat: bool, index: int) -> str:
    """A wave's result file under ``raw/<setup>/<arm>/`` (``--render`` reads it back)."""
    return f"{workload}-c{concurrency}{'-repeat' if repeat else ''}-w{index}.json"


def run_wave(client: Client, server, wave: Wave, setup, tokenizer_path: str, out: Path, arm: str,
             k: int | None) -> dict:
    cell = Cell(wave.workload, "c", wave.concurrency, wave.concurrency, wave.path,
                wave.chat, wave.structured)
    result_dir = out / "raw" / setup.name / arm
    result_dir.mkdir(parents=True, exist_ok=True)
    name = raw_name(wave.workload, wave.concurrency, wave.repeat, wave.index)
    prefix = f"ab-{arm}-{name[:-5]}-"  # the server's request ids carry it (the trace's too)
    argv = _with_xargs(client_args(server, cell, setup, tokenizer_path, result_dir, name)
                       + ["--request-id-prefix", prefix], k)
    log = result_dir / (name[:-5] + ".log")
    try:
        client.run(argv, log)
        raw = json.loads((result_dir / name).read_text())
    except (Exception, SystemExit) as e:
        raise RuntimeError(f"vllm bench serve failed on {arm} {wave.cell} wave {wave.index} "
                           f"({e!r}); log: {log}") from e
    rec = {k_: raw.get(k_) for k_ in KEEP if k_ in raw}
    rec.update(setup=setup.name, arm=arm, k=k, request_id_prefix=prefix, workload=wave.workload,
               concurrency=wave.concurrency, wave=wave.index, repeat=wave.repeat,
               **per_request(raw))
    return rec


# -- statistics ------------------------------------------------------------
# -- the run ---------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m vllm_specplug.tools.bench --ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setups", default="qwen,smollm-ngram",
                   help=f"comma-separated: {', '.join(served.SETUPS)}")
    p.add_argument("--workloads", default=None, help="comma-separated (default: the setup's)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated (default: 1,4,8)")
    p.add_argument("--waves", type=int, default=None,
                   help="waves per cell (default: 6 at c=1, 4 above)")
    p.add_argument("--trace", action="store_true", help="the server writes its decision trace")
    p.add_argument("--out", default="bench-ab", help="output folder")
    p.add_argument("--render", default=None, metavar="DIR",
                   help="rewrite the report of a finished run from its raw/ files")
    p.add_argument("--tiny-root", default="/tmp/vllm-specplug-bench-tiny")
    p.add_argument("--data-cache", default=None)
    args = p.parse_args(argv)
    if args.waves is not None and args.waves < 2:
        raise SystemExit(f"--waves: {args.waves}; allowed: an integer >= 2 (the interval "
                         "resamples waves)")
    return args


def main(argv: list[str] | None = None) -> int:
    from vllm_specplug import compat
    from vllm_specplug.profiling import cpu_model

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    if args.render:
        src = Path(args.render)
        res = json.loads((src / "results.json").read_text())
        runs = [dict(r, **per_request(json.loads(
            (src / "raw" / r["setup"] / r["arm"] / raw_name(
                r["workload"], r["concurrency"], r["repeat"], r["wave"])).read_text())))
            for r in res["runs"]]
        res = summarise(mark_drafting(runs, src), res["meta"], res["failures"])
        write(res, src)
        print(markdown(res))
        return 0
    base_env = server_env()
    out.mkdir(parents=True, exist_ok=True)
    plan = []
    for name in args.setups.split(","):
        setup, target, draft, tok = setup_models(name, args.tiny_root)
        workloads = args.workloads.split(",") if args.workloads else list(setup.workloads)
        conc = ([int(c) for c in args.concurrency.split(",")] if args.concurrency
                else list(CONCURRENCY.get(name, setup.concurrency)))
        cells = build_waves(setup, workloads, conc,
                            lambda c: args.waves or WAVES.get(c, 2), out, tok, args.data_cache)
        plan.append((setup, target, draft, cells))

    def units(setup, wave):
        return cell_units(setup, Cell(wave.workload, "c", wave.concurrency,
                                       wave.concurrency, "", False, False))

    total = sum(setup.ready_s + sum(units(setup, w) * len(arms_of(setup.name))
                                    for cell in cells for w in cell)
                for setup, _, _, cells in plan)
    n = sum(len(arms_of(s.name)) * sum(len(c) for c in cells) for s, _, _, cells in plan)
    print(f"[ab] {n} waves on {len(plan)} server(s); estimate {total / 60:.0f} min. Progress "
          f"and time left follow on stderr.", flush=True)
    progress = Progress(total, "ab")
    client = Client()
    started = time.time()
    runs, failures, servers = [], [], []
    for setup, target, draft, cells in plan:
        arms = arms_of(setup.name)
        port = free_port()
        log = out / "logs" / f"{setup.name}-ab.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        trace = str((out / "logs" / f"{setup.name}-ab-trace.jsonl").resolve()) if args.trace \
            else None
        max_c = max(w.concurrency for cell in cells for w in cell)
        argv_s, env = server_command(setup, "adaptive", target, draft, port, max_c, trace)
        server = Server(argv_s + ["--no-enable-prefix-caching"], {**base_env, **env}, log, port)
        try:
            ready = server.wait_ready()
            progress.advance(setup.ready_s, f"{setup.name}: ready in {ready:.0f} s")
            # Warm-up: one request per arm (the first prompt of the first workload).
            first = cells[0][0]
            warm_path = Path(first.path).with_name("warm-up.jsonl")
            warm_path.write_text(Path(first.path).read_text().splitlines()[0] + "\n")
            warm = dataclasses.replace(first, concurrency=1, index=-1, path=str(warm_path))
            for arm, k in arms:
                run_wave(client, server, warm, setup, target, out, arm, k)
            orders, turn = wave_orders(len(arms)), 0
            for cell in cells:
                for wave in cell:
                    order = orders[turn % len(orders)]
                    turn += 1
                    for arm, k in (arms[i] for i in order):
                        t = time.time()
                        try:
                            rec = run_wave(client, server, wave, setup, target, out, arm, k)
                            runs.append(rec)
                            note = f"{rec['output_throughput']:.2f} tok/s"
                        except RuntimeError as e:
                            failures.append(dict(setup=setup.name, arm=arm, cell=wave.cell,
                                                 error=str(e)))
                            note = "FAILED"
                        progress.advance(units(setup, wave), f"{setup.name} {wave.cell} wave "
                                         f"{wave.index} {arm}: {note} ({time.time() - t:.0f} s)")
            servers.append(dict(setup=setup.name, ready_s=round(ready, 1),
                                kv_tokens=server.kv_tokens(),
                                rss_peak_gib=round(resident_gib(server.proc.pid, "VmHWM"), 2)))
        except RuntimeError as e:
            failures.append(dict(setup=setup.name, arm=None, cell=None, error=str(e)))
            print(f"[ab] FAILED {setup.name}: {e}", file=sys.stderr)
        finally:
            server.stop()
    client.close()
    meta = dict(command="python -m vllm_specplug.tools.bench " + " ".join(argv),
                commit=served.commit(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                wall_minutes=round((time.time() - started) / 60, 1),
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}",
                vllm=compat.vllm_version(), setups={s.name: s.title for s, *_ in plan},
                dtype={s.name: s.dtype or "bfloat16" for s, *_ in plan},
                output_tokens={s.name: s.output_tokens for s, *_ in plan},
                arms={s.name: [a for a, _ in arms_of(s.name)] for s, *_ in plan},
                servers=servers)
    res = summarise(mark_drafting(runs, out), meta, failures)
    write(res, out)
    print(markdown(res))
    return 1 if failures else 0




if __name__ == "__main__":
    sys.exit(main())
