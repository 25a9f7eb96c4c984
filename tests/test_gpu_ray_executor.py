"""vLLM's Ray executor with the plugin: GPU machines only.

vLLM 0.32 refuses the Ray executor on its CPU platform ("current platform cpu
does not support ray"), so this is skipped here and in CI; it runs wherever
CUDA and Ray are present (``pytest tests/test_gpu_ray_executor.py``).  It
checks what the plugin must not break under Ray: the scheduler (and the
controller) stay in the engine core, the ranks are Ray actors that get every
decision in ``SchedulerOutput``, and greedy output equals plain decoding.
"""

import pytest

from conftest import CEILING, greedy, make_llm, scheduler_of, shutdown, token_ids
from helpers import prompt

torch = pytest.importorskip("torch")
pytest.importorskip("ray", reason="the [ray] extra is not installed")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="vLLM's Ray executor runs on GPU platforms only (CPU refuses it)"),
]

PROMPTS = [prompt(i) for i in range(6)]


def test_ray_executor_greedy_equals_plain(tiny_models):
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    plain = make_llm(tiny_models["target"])
    want = token_ids(plain.generate(PROMPTS, greedy(64), use_tqdm=False))
    shutdown(plain)
    llm = make_llm(tiny_models["target"], distributed_executor_backend="ray",
                   tensor_parallel_size=tp, gpu_memory_utilization=0.3,
                   speculative={"method": "draft_model", "model": tiny_models["target"],
                                "num_speculative_tokens": CEILING})
    try:
        caps = [None, 0, 1, CEILING, 2, None]
        params = [greedy(64, extra_args=None if c is None else {"specplug_max_k": c})
                  for c in caps]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert token_ids(outs) == want
        sched = scheduler_of(llm).specplug
        assert sched.enabled and sched.controller.stats.drafted > 0
        for o, cap in zip(outs, caps):
            drafted = list(o.outputs[0].spec_decode_metrics.per_step_drafted)
            assert max(drafted, default=0) <= (CEILING if cap is None else cap)
    finally:
        shutdown(llm)
