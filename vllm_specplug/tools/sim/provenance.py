"""What a simulator run records of where it came from: the controller's
source digest, the git revision, the run's command line and options."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path


def controller_sha() -> str:
    root = Path(__file__).resolve().parents[2] / "controller"
    h = hashlib.sha256()
    for p in sorted(root.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def git_rev() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "vllm_specplug/controller"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + ("+controller-modified" if dirty else "")
    except Exception:
        return "unknown"



def meta_for(argv: list[str], opts: dict, runtime: float) -> dict:
    return {"command": "python -m vllm_specplug.tools.sim " + " ".join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M"), "runtime_s": runtime,
            "controller_sha": controller_sha(), "git": git_rev(),
            "cpu_count": os.cpu_count(), **opts}
