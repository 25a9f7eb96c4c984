"""A process can start engine after engine with the controller loaded.

numba (vLLM's n-gram proposer imports it) makes vLLM CPU's
kernel-override scan fail at the next engine start in the same process
unless the plugin's patch is in place (vllm_specplug/patches/
kernel_override_scan.py).  Test sessions, notebooks and the benchmark (a
plain engine after a speculative one) all start several engines.
"""

from conftest import CEILING, greedy, make_llm, shutdown, token_ids


def test_engines_start_one_after_another_with_numba_loaded(tiny_models):
    from vllm_specplug import plugin
    import numba  # noqa: F401  (loaded in this process, as vLLM's n-gram proposer does)

    outputs = []
    # Speculative first, then plain: the benchmark's order.
    for speculative in ({"method": "draft_model", "model": tiny_models["target"],
                         "num_speculative_tokens": CEILING}, None):
        llm = make_llm(tiny_models["target"], speculative=speculative)
        try:
            outputs.append(token_ids(llm.generate(["a b c d"], greedy(max_tokens=16))))
        finally:
            shutdown(llm)
    assert plugin._STATE["patches"]["kernel_override_scan"] is None
    assert outputs[0] == outputs[1]
