"""Scaling out with ``vllm-specplug serve``: tensor and data parallelism.

- TP=2 from the shipped ``configs/qwen-coder-tp2.yaml`` (tiny models
  substituted): target and draft split over two ranks, one core each.
- DP=2: two engine cores, each with its own scheduler and controller.  For a
  dense model vLLM runs DP ranks as independent engines (each is told
  ``data_parallel_size=1``), so each adapts K_step on its own; ranks that step
  in lockstep (MoE) keep K_step fixed, which is tested at the scheduler level
  (``test_scheduler_level.py``) because no MoE model runs here.

Every completion is compared with the same request at ``specplug_max_k=0``
(plain decoding on the same server), token for token.
"""

import threading
import time

import requests

from serving import CONFIGS, PROMPT, Server, client, metric_sum

# One core per rank: this machine has one NUMA node, which vLLM's automatic
# binding refuses to split.
ONE_CORE_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
PROMPTS = [PROMPT + f" w{i} w{i + 5}" for i in range(8)]


def completions_match_plain(server, max_tokens=40):
    """All PROMPTS at once (so DP spreads them), then again with the ceiling
    at 0; returns the responses of the speculative run."""
    url = server.url + "/v1/completions"
    results: dict[tuple[int, bool], dict] = {}

    def one(i, plain):
        body = {"model": server.model, "prompt": PROMPTS[i], "max_tokens": max_tokens,
                "temperature": 0}
        if plain:
            body["vllm_xargs"] = {"specplug_max_k": 0}
        r = requests.post(url, json=body, timeout=300)
        assert r.status_code == 200, r.text
        results[(i, plain)] = r.json()

    for plain in (False, True):
        threads = [threading.Thread(target=one, args=(i, plain)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(len(PROMPTS)):
        assert results[(i, False)]["choices"][0]["text"] == \
            results[(i, True)]["choices"][0]["text"], PROMPTS[i]
    return [results[(i, False)] for i in range(len(PROMPTS))]


def assert_drafts_accepted(m):
    """A perfect draft (the target itself): speculation ran and vLLM accepted
    (nearly) every draft.  How many drafts the controller grants at this
    batch size depends on the cost it measures, so that is not asserted."""
    drafted = metric_sum(m, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"drafted {drafted:.0f}, accepted {accepted:.0f}, request-steps by k: "
          + str({k: metric_sum(m, "vllm:specplug_request_steps_total", k=str(k))
                 for k in range(5)}))
    assert drafted >= 100 and accepted >= 0.9 * drafted, m


def test_tp2_config_serves_exact_output(tiny_models, tmp_path):
    server = Server(CONFIGS / "qwen-coder-tp2.yaml", {
        "model": tiny_models["target"],
        "speculative-config": {"model": tiny_models["target"], "num_speculative_tokens": 4},
        "additional-config": {"specplug": {"log_interval_s": 1}},
    }, tmp_path, "tp2", env=ONE_CORE_PER_RANK).start()
    try:
        completions_match_plain(server)
        time.sleep(1.5)
        m = server.metrics()
        assert_drafts_accepted(m)
        log = server.tail(2000)
        assert "tensor_parallel_size=2" in log or "'tensor_parallel_size': 2" in log
        assert "K_step=adaptive" in log and "zero-cost fallback on" in log
    finally:
        server.stop()


def test_dp2_each_rank_adapts_and_output_is_exact(tiny_models, tmp_path):
    server = Server(CONFIGS / "qwen-coder-adaptive.yaml", {
        "model": tiny_models["target"],
        "speculative-config": {"model": tiny_models["target"], "num_speculative_tokens": 4},
        "additional-config": {"specplug": {"log_interval_s": 1}},
        "data-parallel-size": 2,
    }, tmp_path, "dp2", env=ONE_CORE_PER_RANK).start()
    try:
        completions_match_plain(server)
        time.sleep(1.5)
        m = server.metrics()
        # Both engines served requests, each under its own engine label.
        for engine in ("0", "1"):
            assert metric_sum(m, "vllm:specplug_request_steps_total", engine=engine) > 0, m
        assert_drafts_accepted(m)
        log = server.tail(2000)
        started = [line for line in log.splitlines() if "adaptive speculation on" in line]
        assert len(started) == 2 and all("K_step=adaptive" in line for line in started), started
        assert server.healthy()
        r = client(server).completions.create(model=server.model, prompt=PROMPT,
                                              max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
    finally:
        server.stop()

