"""The n-gram lookup's numba threads on vLLM's CPU build (patches/ngram_threads.py).

Which threading layer numba runs is fixed once per process, so each case
runs in a fresh interpreter: vLLM's own NgramProposer, built and run once,
with and without the patch."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from types import SimpleNamespace as N
import numpy as np
if sys.argv[1] == "patched":
    from vllm_specplug.patches import ngram_threads
    assert ngram_threads.install() is None
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
cfg = N(speculative_config=N(prompt_lookup_min=2, prompt_lookup_max=3, num_speculative_tokens=3),
        model_config=N(max_model_len=32), scheduler_config=N(max_num_seqs=2),
        parallel_config=N(tensor_parallel_size=1))
proposer = NgramProposer(cfg)
tokens = np.zeros((2, 32), dtype=np.int32)
tokens[0, :8] = [5, 6, 7, 8, 5, 6, 7, 8]
tokens[1, :4] = [1, 2, 3, 4]
drafts = proposer.propose(3, [[8], [1]], np.array([8, 4], dtype=np.int32), tokens)
import numba
print(numba.threading_layer(), drafts)
"""


def _run(mode, **env):
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_lookup_runs_on_workqueue_threads_and_proposes_the_same():
    patched, vllms = _run("patched"), _run("vllm")
    assert patched.startswith("workqueue ")
    assert not vllms.startswith("workqueue ")  # what the patch changes
    assert patched.split(" ", 1)[1] == vllms.split(" ", 1)[1] == "[[5, 6, 7], []]"


def test_a_users_threading_layer_is_kept():
    from vllm_specplug.patches import ngram_threads
    assert ngram_threads.choose_layer(False) == "not the CPU platform"
    assert _run("patched", NUMBA_THREADING_LAYER="omp").startswith("omp ")


@pytest.mark.parametrize("running", ["omp", "workqueue"])
def test_threads_already_running_are_left_alone(monkeypatch, running):
    import numba
    from vllm_specplug.patches import ngram_threads
    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    monkeypatch.setattr(numba, "threading_layer", lambda: running)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "default")
    why = ngram_threads.choose_layer(True)
    assert (why is None) == (running == "workqueue")
    assert numba.config.THREADING_LAYER == ("workqueue" if running == "workqueue" else "default")
