"""Installing the plugin never replaces the vLLM a user has (no engine)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("installed", ["0.32.0", "0.33.0", "0.34.0"])
def test_the_gpu_extra_keeps_the_installed_vllm(tmp_path, installed):
    """``pip install --dry-run '.[gpu]'`` beside an installed vLLM: pip's plan
    installs the plugin alone.  The installed vLLM is a distribution's metadata
    (what pip reads), on the path of the pip that runs; no index is asked, so a
    pin that excluded it would fail to resolve instead of downgrading."""
    site = tmp_path / "site" / f"vllm-{installed}.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {installed}\n")
    (site / "RECORD").write_text("")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--quiet", "--report", str(report), f"{ROOT}[gpu]"],
        env={"PYTHONPATH": str(site.parent), "PATH": "/usr/bin:/bin",
             "HOME": str(tmp_path), "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert plan == ["vllm-specplug"], plan
