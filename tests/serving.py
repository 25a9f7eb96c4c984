"""``vllm-specplug serve`` on loopback for the server tests (``test_server.py``,
``test_scaling_server.py``, ``test_soak.py``): a shipped config with the tiny
models and test sizes substituted, its client and its metrics."""

import os
import sys
from pathlib import Path

import requests
import yaml

from conftest import with_fixed_profile
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
START_TIMEOUT_S = 300


class Server:
    def __init__(self, config: Path, overrides: dict, tmp: Path, name: str,
                 env: dict | None = None, vllm_own: bool = False) -> None:
        self.extra_env = env or {}
        # vllm_own: vLLM's own server entry point instead of `vllm-specplug serve`.
        self.vllm_own = vllm_own
        cfg = yaml.safe_load(config.read_text())
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        section = cfg.setdefault("additional-config", {})
        section["specplug"] = with_fixed_profile(section.get("specplug"))
        self.port = free_port()
        cfg.update({"port": self.port, "host": "127.0.0.1", "max-model-len": 512,
                    "enforce-eager": True, "dtype": "float32", "max-num-seqs": 16})
        self.cfg = cfg
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.log_path = tmp / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = cfg["served-model-name"]

    def start(self) -> "Server":
        """Launched and waited for as the served benchmark launches its servers
        (``vllm_specplug.tools.bench.Server``)."""
        from vllm_specplug.tools.bench.server import Server

        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a real server: engine in its own process
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(self.extra_env)
        if self.vllm_own:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        else:
            cmd = [str(Path(sys.executable).with_name("vllm-specplug")), "serve"]
        self.process = Server(cmd + ["--config", str(self.config_path)], env,
                                     self.log_path, self.port)
        self.proc = self.process.proc
        try:
            self.process.wait_ready(START_TIMEOUT_S)
        except RuntimeError:
            self.stop()
            raise
        return self

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-n:])

    def healthy(self) -> bool:
        return requests.get(self.url + "/health", timeout=5).status_code == 200

    def metrics(self) -> dict[str, float]:
        """Prometheus text → {series with labels: value}, our and vLLM's spec series."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            if "specplug" in name or "spec_decode" in name:
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.process.stop()


def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metric_sum(metrics: dict[str, float], name: str, **labels) -> float:
    total = 0.0
    for series, value in metrics.items():
        base = series.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += value
    return total


PROMPT = " ".join(f"w{i}" for i in range(3, 40, 3))
