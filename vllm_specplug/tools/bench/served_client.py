"""The served benchmark's client: ``vllm bench serve`` (vLLM's own, run in
this process) on one cell against a running server, and what is kept of its
results."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_specplug.tools.bench.server import SERVED_NAME
from vllm_specplug.tools.bench.served_report import spec_rates

if TYPE_CHECKING:
    from vllm_specplug.tools.bench.server import Server
    from vllm_specplug.tools.bench.served_grid import Cell
    from vllm_specplug.tools.bench.setups import ServedSetup

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
