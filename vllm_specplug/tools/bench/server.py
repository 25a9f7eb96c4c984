"""The served benchmark's servers: the command line of each arm, the process
(started, awaited on ``/health``, stopped), its spec-decode counters and the
resident memory of it and its children."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_specplug.tools.bench.setups import VLLM_TABLE

if TYPE_CHECKING:
    from vllm_specplug.tools.bench.setups import ServedSetup

SERVED_NAME = "bench-target"


def free_port() -> int:
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
