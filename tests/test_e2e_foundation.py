"""The plugin on real vLLM (CPU): entry point, and greedy equality across
plain decoding, draft_model and ngram speculative decoding."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import greedy, make_llm, plain_token_ids, shutdown, token_ids
from helpers import prompt, repetitive_prompt
from vllm_specplug.tools.testing import easy_prompt, hard_prompt, make_successor_models

PROMPTS = [prompt(i) for i in range(4)] + [repetitive_prompt(i) for i in range(4)]
# n-gram lookup needs text that repeats.  The tiny random target's greedy
# text rarely does: eight requests drafted one token in all, some runs none,
# and "speculation never ran" failed CI.  So the n-gram case runs on the
# successor target, whose greedy text continues the prompt's cycle (easy
# prompts draft well, hard ones get wrong drafts).
NGRAM_PROMPTS = [easy_prompt(i) for i in range(4)] + [hard_prompt(i) for i in range(4)]


def test_entry_points_are_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "vllm_specplug.plugin:register" in {ep.value for ep in eps}


def test_the_v2_model_runner_loads_with_the_plugin_installed():
    """vLLM's V2 runner (its GPU default) refuses any installed logits-processor
    plugin of the V1 interface, in the front end and in the worker; the plugin
    registers none, so vLLM's own loader accepts this environment."""
    from vllm.v1.worker.gpu.sample.logits_processor import loader

    ours = [ep for ep in importlib.metadata.entry_points(group=loader.LOGITSPROCS_GROUP)
            if ep.value.startswith("vllm_specplug")]
    assert ours == []
    assert loader._load_v2_logitsprocs_plugins() == []
    validate = loader.build_custom_logits_processors_params_validator(())
    from vllm import SamplingParams

    validate(SamplingParams(max_tokens=4))


def test_register_is_idempotent(tmp_path, monkeypatch):
    from vllm_specplug import plugin

    log = tmp_path / "pids"
    monkeypatch.setenv("VLLM_SPECPLUG_REGISTER_LOG", str(log))
    monkeypatch.setattr(plugin, "_STATE", {})
    plugin.register()
    plugin.register()
    assert log.read_text().split() == [str(os.getpid())]
    assert plugin.missing_features() == []


def test_vllm_calls_the_plugin_in_the_engine_core_process(tiny_models, tmp_path):
    """Multiprocess mode: the engine core (a separate process) loads us."""
    log = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={tiny_models['target']!r}, enforce_eager=True, max_model_len=256,
                      dtype="float32")
            out = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=4, temperature=0))
            print("MAIN", os.getpid(), len(out[0].outputs[0].token_ids))
    """)
    path = tmp_path / "run.py"
    path.write_text(script)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_SPECPLUG_REGISTER_LOG=str(log))
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    main_pid = [ln for ln in proc.stdout.splitlines() if ln.startswith("MAIN")][0].split()[1]
    pids = set(log.read_text().split())
    assert main_pid in pids
    assert pids - {main_pid}, "the plugin was not loaded in any other (engine-core) process"


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    return plain_token_ids(tiny_models["target"], PROMPTS)


@pytest.fixture(scope="module")
def successor_target(tmp_path_factory):
    return make_successor_models(tmp_path_factory.mktemp("successor-models"))["copy_target"]


@pytest.fixture(scope="module")
def plain_ngram_outputs(successor_target):
    return plain_token_ids(successor_target, NGRAM_PROMPTS)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["vllm-static", "adaptive"])
def test_greedy_output_identical_to_plain(request, tiny_models, method, adaptive):
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        target, prompts = tiny_models["target"], PROMPTS
        spec["model"] = target
        plain = request.getfixturevalue("plain_outputs")
    else:
        target, prompts = request.getfixturevalue("successor_target"), NGRAM_PROMPTS
        spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
        plain = request.getfixturevalue("plain_ngram_outputs")
    llm = make_llm(target, speculative=spec, adaptive=adaptive)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    shutdown(llm)
    assert token_ids(outs) == plain
    drafted = sum(o.outputs[0].spec_decode_metrics.num_draft_tokens for o in outs)
    assert drafted > 0, "speculation never ran: the comparison would prove nothing"
