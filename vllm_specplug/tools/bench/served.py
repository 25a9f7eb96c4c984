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
import contextlib
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_specplug.tools.bench.runner import Progress, resolve_model
from vllm_specplug.tools.bench.served_report import ORDER as ARMS, spec_rates
from vllm_specplug.tools.bench.setups import VLLM_TABLE

SERVED_NAME = "bench-target"


@dataclass(frozen=True)
class ServedSetup:
    name: str
    title: str
    target: str  # model-cache key (or tiny:...)
    method: str
    draft: str | None
    ceiling: int
    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    requests: int  # per run at concurrency 1; waves * c at concurrency c > 1
    rate: float  # requests per second of the Poisson cell (0: none)
    rate_workload: str = "mixed"  # the one workload that gets the Poisson cell
    # The grid's arms; vllm-k6, vllm-k8 and adaptive-history only when asked for (--arms).
    arms: tuple[str, ...] = ("plain", "vllm-k2", "vllm-k4", "vllm-table", "plugin-k2", "adaptive")
    max_model_len: int = 1024
    max_prompt_tokens: int = 384
    dtype: str | None = None
    spec_extra: dict = field(default_factory=dict)
    # For the up-front estimate only (measured costs replace it).
    nominal_tok_s: float = 6.0
    prefill_s_per_token: float = 0.01
    ready_s: float = 60.0


SETUPS = {
    "qwen": ServedSetup(
        name="qwen", title="Qwen2.5-Coder-1.5B + 0.5B draft (draft_model)",
        target="qwen-coder-1.5b", method="draft_model", draft="qwen-coder-0.5b", ceiling=8,
        workloads=("humaneval", "sharegpt", "mixed", "json"), concurrency=(1, 4),
        output_tokens=64, requests=3, rate=0.0,
        # vLLM's batch table gives K=4 to one request and K=2 to four: at this
        # grid's loads it is the vllm-k4 and vllm-k2 arms, so it is not run twice.
        arms=("plain", "vllm-k2", "vllm-k4", "adaptive"),
        nominal_tok_s=5.4, prefill_s_per_token=0.005, ready_s=65.0),
    "smollm-ngram": ServedSetup(
        name="smollm-ngram", title="SmolLM2-135M + n-gram prompt lookup",
        target="smollm2-135m", method="ngram", draft=None, ceiling=8,
        spec_extra={"prompt_lookup_min": 2, "prompt_lookup_max": 5},
        workloads=("humaneval", "sharegpt", "mixed", "json"), concurrency=(1, 2, 4, 8),
        output_tokens=64, requests=3, rate=1.0,
        nominal_tok_s=26.0, prefill_s_per_token=0.001, ready_s=35.0),
    # Smoke test only: tiny random-weight models made on the spot.
    "tiny": ServedSetup(
        name="tiny", title="tiny successor models (smoke test)",
        target="tiny:copy_target", method="draft_model", draft="tiny:copy_draft_half",
        ceiling=4, workloads=("easy", "hard"), concurrency=(1, 2), output_tokens=16,
        requests=2, rate=0.0, max_model_len=512, dtype="float32",
        nominal_tok_s=60.0, prefill_s_per_token=0.0, ready_s=30.0),
}

QUICK = dict(setups=["qwen"], workloads=["humaneval", "sharegpt"], concurrency=[1, 4],
             arms=["plain", "vllm-k4", "adaptive"])

JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "args": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "string"},
    },
    "required": ["name", "args", "returns"],
    "additionalProperties": False,
}
JSON_INSTRUCTION = ("Describe the Python function below as a JSON object with the keys "
                    "name, args (a list of argument names) and returns (what it returns).\n\n")


# -- workloads ---------------------------------------------------------------
@dataclass
class Cell:
    workload: str
    kind: str  # "cold", "c", "rate", "repeat"
    concurrency: int  # 0 for the rate cell
    requests: int
    path: str
    chat: bool  # the chat endpoint (the server applies the template)
    structured: bool

    @property
    def key(self) -> str:
        load = f"rate{self.concurrency}" if self.kind == "rate" else f"c{self.concurrency}"
        return f"{self.workload}/{load}/{self.kind}"


def _sources(setup: ServedSetup, workload: str, tokenizer, data_cache) -> tuple[list[str], bool]:
    """(prompts in their seeded order, sent to the chat endpoint?)."""
    rng = random.Random(0)
    if setup.name == "tiny":
        from vllm_specplug.tools.testing import easy_prompt, hard_prompt

        make = easy_prompt if workload == "easy" else hard_prompt
        return [make(i) for i in range(64)], False
    from vllm_specplug.tools import datasets

    def fits(text):
        return len(tokenizer(text).input_ids) <= setup.max_prompt_tokens

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)

    def sample(key, n, render=None):
        recs = datasets.load(key, data_cache)
        rng.shuffle(recs)
        out = []
        for r in recs:
            text = render(r["prompt"]) if render else r["prompt"]
            if fits(text):
                out.append(text)
                if len(out) >= n:
                    break
        return out

    if workload == "humaneval":
        return sample("humaneval", 164), False
    if workload == "sharegpt":
        # The chat endpoint renders the turn; the length filter counts it rendered.
        return [t for t in sample("sharegpt", 200)
                if fits(chat(t))], True
    if workload == "mixed":
        code, talk = sample("humaneval", 164), sample("sharegpt", 200, chat)
        return [p for pair in zip(code, talk) for p in pair], False
    if workload == "json":
        return sample("humaneval", 164, lambda p: chat(JSON_INSTRUCTION + p)), False
    raise SystemExit(f"unknown workload {workload!r}; known: humaneval, sharegpt, mixed, json")


def build_cells(setup, workloads, concurrency, with_rate, out: Path, tokenizer,
                data_cache=None, requests: int | None = None, waves: int = 2,
                cold_requests: int | None = None) -> list[Cell]:
    """Each cell's own prompts (disjoint slices, so no cell reuses another's prefix cache).
    ``requests``: a c=1 cell's requests (default the setup's); a cell at c > 1
    sends ``waves * c``; ``cold_requests``: the cold run's (default the setup's)."""
    cells = []
    single = requests or setup.requests
    for w in workloads:
        prompts, is_chat = _sources(setup, w, tokenizer, data_cache)
        loads = [("c", c, single if c == 1 else waves * c) for c in concurrency]
        if with_rate and setup.rate > 0 and w == setup.rate_workload:
            loads.append(("rate", 0, 2 * max(concurrency)))
        if w == workloads[0]:
            loads.insert(0, ("cold", 1, cold_requests or setup.requests))
        at = 0
        for kind, c, n in loads:
            if at + n > len(prompts):
                raise SystemExit(f"{setup.name} {w}: {len(prompts)} prompts fit in "
                                 f"{setup.max_prompt_tokens} tokens, the grid needs {at + n}")
            path = out / "workloads" / setup.name / f"{w}-{kind}{c}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                for p in prompts[at:at + n]:
                    f.write(json.dumps({"prompt": p, "output_tokens": setup.output_tokens}) + "\n")
            at += n
            cells.append(Cell(w, kind, c, n, str(path), is_chat, w == "json"))
    first = next(c for c in cells if c.kind == "c")
    cells.append(Cell(first.workload, "repeat", first.concurrency, first.requests, first.path,
                      first.chat, first.structured))
    return cells


# -- servers -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(setup: ServedSetup, arm: str, target: str, draft: str | None, port: int,
                   max_num_seqs: int, trace_path: str | None = None) -> tuple[list[str], dict]:
    """(argv, extra environment) of ``vllm-specplug serve`` for one arm.

    ``trace_path``: the adaptive arm writes its decision trace there."""
    argv = [sys.executable, "-m", "vllm_specplug.tools.cli", "serve", target,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-model-len", str(setup.max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enforce-eager", "--seed", "0"]
    if setup.dtype:
        argv += ["--dtype", setup.dtype]
    env = {}
    if arm != "plain":
        k = {"vllm-k2": 2, "vllm-k4": 4, "vllm-k6": 6, "vllm-k8": 8,
             "plugin-k2": 2, "plugin-k0": 0}.get(arm, setup.ceiling)
        spec = {"method": setup.method, "num_speculative_tokens": k or setup.ceiling,
                **setup.spec_extra}
        if draft:
            spec["model"] = draft
        if arm == "vllm-table":
            spec["num_speculative_tokens_per_batch_size"] = [
                [lo, hi, min(kk, setup.ceiling)] for lo, hi, kk in VLLM_TABLE]
        argv += ["--speculative-config", json.dumps(spec)]
    if arm in ("adaptive", "adaptive-history", "plugin-k2", "plugin-k0"):
        specplug = ({"policy": "goodput"} if arm == "adaptive" else
                    {"policy": "goodput", "draft_confidence": False}
                    if arm == "adaptive-history" else {"policy": "static", "static_k": k})
        if trace_path:
            specplug["trace_path"] = trace_path
        argv += ["--scheduler-cls", "vllm_specplug.AdaptiveSpecScheduler",
                 "--additional-config", json.dumps({"specplug": specplug})]
    else:
        # vLLM as a user runs it: no plugin of this package is loaded.
        env["VLLM_PLUGINS"] = "none"
    return argv, env


def server_env() -> dict:
    """The servers' environment (this process's is left alone)."""
    from vllm_specplug.tools.bench.runner import env_defaults

    env = dict(os.environ)
    env_defaults(env)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs as users run it
    return env


def setup_models(name: str, tiny_root: str) -> tuple[ServedSetup, str, str | None, object]:
    """A setup by name, its target and draft paths, and the target's tokenizer."""
    from transformers import AutoTokenizer

    if name not in SETUPS:
        raise SystemExit(f"--setups: unknown {name!r}; known: {', '.join(SETUPS)}")
    setup = SETUPS[name]
    target = resolve_model(setup.target, tiny_root)
    draft = resolve_model(setup.draft, tiny_root) if setup.draft else None
    return setup, target, draft, AutoTokenizer.from_pretrained(target)


def _children(pid: int) -> list[int]:
    kids, out = {}, [pid]
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    i = 0
    while i < len(out):
        out += kids.get(out[i], [])
        i += 1
    return out


def resident_gib(pid: int, field_name: str = "VmRSS") -> float:
    """Resident memory of a process and its descendants (GiB)."""
    total = 0
    for p in _children(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith(field_name + ":"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 2**20


KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


class Server:
    def __init__(self, argv, env, log_path: Path, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> float:
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"ready; its log: {self.log_path}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - self.t0
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"server not ready after {timeout:.0f} s; log: {self.log_path}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kv_tokens(self) -> int | None:
        m = KV_LINE.findall(self.log_path.read_text(errors="replace"))
        return int(m[-1].replace(",", "")) if m else None

    def spec_counters(self) -> dict:
        """vLLM's spec-decode counters, summed over labels."""
        out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
        names = {"vllm:spec_decode_num_drafts_total": "drafts",
                 "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return out
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                try:
                    out[names[name]] += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()


# -- the client --------------------------------------------------------------
def client_args(server: Server, cell: Cell, setup: ServedSetup, tokenizer_path: str,
                result_dir: Path, name: str) -> list[str]:
    """The arguments of ``vllm bench serve`` for one cell."""
    argv = ["--backend", "openai-chat" if cell.chat else "vllm",
            "--base-url", server.base,
            "--endpoint", "/v1/chat/completions" if cell.chat else "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", tokenizer_path,
            "--dataset-name", "custom", "--dataset-path", cell.path,
            "--num-prompts", str(cell.requests), "--disable-shuffle", "--skip-chat-template",
            "--custom-output-len", str(setup.output_tokens),
            "--temperature", "0", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            # Waiting on /health is done here: vLLM's ready check sends a full
            # request first, which would warm a cold server.
            "--ready-check-timeout-sec", "0", "--num-warmups", "0",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", name, "--disable-tqdm"]
    if cell.kind == "rate":
        argv += ["--request-rate", str(setup.rate)]
    else:
        argv += ["--request-rate", "inf", "--max-concurrency", str(cell.concurrency)]
    if cell.structured:
        # The grammar ends the object; ignore_eos would run past it.
        argv += ["--extra-body", json.dumps({"structured_outputs": {"json": JSON_SCHEMA}})]
    else:
        argv += ["--ignore-eos"]
    return argv


KEEP = ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
        "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
        "p50_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms")


def vllm_bench_serve(argv: list[str], log: Path) -> None:
    """vLLM's own ``vllm bench serve`` with these arguments, in this process.

    As a program it would import vLLM again for every run (about 10 s here,
    a third of a short run's wall time); its library entry point is the same
    code the CLI calls (``vllm.entrypoints.cli.benchmark.serve``).  Its
    report goes to ``log``.
    """
    from vllm_specplug.tools.serve import install_version_shim

    install_version_shim()  # the CPU build: vLLM asks for its own version
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        bench_main(args)


def per_request(raw: dict) -> dict:
    """Per-request figures from a ``--save-detailed`` result of ``vllm bench serve``.

    A request's TPOT is its time after the first token over the tokens after
    it, as vLLM's client reckons ``mean_tpot_ms``: with speculation a stream
    chunk carries several tokens, so the mean gap between chunks is not it.
    """
    itls, lens = raw.get("itls") or [], raw.get("output_lens") or []
    return dict(tpots_ms=[1e3 * sum(x) / (n - 1) for x, n in zip(itls, lens) if x and n > 1],
                ttfts_ms=[1e3 * x for x in raw.get("ttfts") or [] if x],
                texts=raw.get("generated_texts") or [], output_lens=lens)


def raw_path(out: Path, setup: str, arm: str, key: str, rnd: int = 1) -> Path:
    return (out / "raw" / setup / arm / (f"round{rnd}" if rnd > 1 else "")
            / (key.replace("/", "-") + ".json"))


def run_cell(server, cell, setup, tokenizer_path, out: Path, arm: str, rnd: int = 1) -> dict:
    path = raw_path(out, setup.name, arm, cell.key, rnd)
    result_dir, name = path.parent, path.name
    result_dir.mkdir(parents=True, exist_ok=True)
    before = server.spec_counters()
    argv = client_args(server, cell, setup, tokenizer_path, result_dir, name)
    log = result_dir / (name[:-5] + ".log")
    try:
        vllm_bench_serve(argv, log)
    except (Exception, SystemExit) as e:  # argparse exits; a failed run must not end the grid
        raise RuntimeError(f"vllm bench serve failed on {arm} {cell.key} ({e!r}); log: {log}\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-20:])) from e
    if not (result_dir / name).is_file():
        raise RuntimeError(f"vllm bench serve wrote no result on {arm} {cell.key}; log: {log}")
    raw = json.loads((result_dir / name).read_text())
    after = server.spec_counters()
    d = {k: after[k] - before[k] for k in after}
    rec = {k: raw.get(k) for k in KEEP if k in raw}
    rec.update(setup=setup.name, arm=arm, workload=cell.workload, kind=cell.kind,
               concurrency=cell.concurrency, rate=setup.rate if cell.kind == "rate" else None,
               requests=cell.requests, round=rnd, spec_counts=d, **spec_rates(d))
    rec.update(per_request(raw))
    errors = [e for e in (raw.get("errors") or []) if e]
    if errors:
        rec["errors"] = errors[:5]
    return rec


# -- the grid ----------------------------------------------------------------
def _cell_units(setup, cell) -> float:
    """A cell's nominal seconds: the up-front estimate and the progress bar's unit."""
    c = max(cell.concurrency, 1)
    return (cell.requests * setup.output_tokens / (setup.nominal_tok_s * min(c, 3) ** 0.6)
            + cell.requests * 150 * setup.prefill_s_per_token + 3)


def _estimate(setup, cells, arms) -> float:
    return (setup.ready_s + sum(_cell_units(setup, c) for c in cells)) * len(arms)


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
    from vllm_specplug import compat
    from vllm_specplug.profiling import cpu_model
    from vllm_specplug.tools.bench import served_report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        return render(Path(args.render))
    if args.pool:
        return pool([Path(d) for d in args.pool], Path(args.out))
    base_env = server_env()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    total = args.rounds * sum(_estimate(s, cells, a) for s, _, _, cells, a in plan)
    n_runs = args.rounds * sum(len(cells) * len(a) for _, _, _, cells, a in plan)
    print(f"[served] {n_runs} runs, {args.rounds * sum(len(a) for *_, a in plan)} server starts; "
          f"estimate {total / 60:.0f} min. Progress and time left follow on stderr.", flush=True)
    progress = Progress(total, "served")
    started = time.time()
    runs, servers, failures = [], [], []
    for rnd, (setup, target, draft, cells, setup_arms) in (
            (r, p) for r in range(args.rounds) for p in plan):
        max_c = max(c.concurrency for c in cells)
        if any(c.kind == "rate" for c in cells):
            max_c *= 2  # Poisson arrivals can pile up past the closed loop's peak
        tag = f"-r{rnd + 1}" if args.rounds > 1 else ""
        for arm in (setup_arms if rnd % 2 == 0 else setup_arms[::-1]):
            port = _free_port()
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
                    progress.advance(setup.ready_s + sum(_cell_units(setup, c) for c in cells),
                                     f"{setup.name} {arm}: failed to start")
                    continue
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
                    progress.advance(_cell_units(setup, cell), f"{setup.name} {arm} {cell.key}: "
                                     + (f"{rec.get('output_throughput', 0):.2f} tok/s"
                                        if rec else "FAILED") + f" ({time.time() - t:.0f} s)")
                info["rss_peak_gib"] = round(resident_gib(server.proc.pid, "VmHWM"), 2)
                servers.append(info)
            finally:
                server.stop()
    meta = dict(
        command="python -m vllm_specplug.tools.bench " + " ".join(argv),
        commit=_commit(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
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


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
