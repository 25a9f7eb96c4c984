"""One answer to "does the zero-cost fallback apply here?" for the scheduler and the workers,
and an import graph that runs one way (no engine)."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_specplug import deployment, runners

PKG = Path(__file__).resolve().parents[1] / "vllm_specplug"


class _Model:
    def __init__(self, vocab, **kw):
        self.vocab = vocab
        self.__dict__.update(kw)

    def get_vocab_size(self):
        return self.vocab


def vllm_config(method="draft_model", scheduler="vllm_specplug.AdaptiveSpecScheduler", dp=1,
                pp=1, draft_vocab=100, **model):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler),
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=4,
                                           draft_model_config=_Model(draft_vocab)),
        parallel_config=SimpleNamespace(data_parallel_size=dp, pipeline_parallel_size=pp),
        model_config=_Model(100, **model), additional_config={})


def test_zero_cost_fallback_applies_only_where_every_rank_can_skip(monkeypatch):
    monkeypatch.setattr(runners, "model_runner_name", lambda cfg: "cpu-v1")
    assert deployment.zero_cost_fallback_for(vllm_config(), True) == (True, "")
    for cfg, enabled, why in [
        (vllm_config(), False, "off in the plugin config"),
        (vllm_config(method="ngram"), True, "not draft_model"),
        (vllm_config(scheduler="vllm.v1.core.sched.scheduler.Scheduler"), True, "not vllm_specplug"),
        (vllm_config(dp=2), True, "pinned"),
        (vllm_config(pp=2), True, "pipeline"),
        (vllm_config(draft_vocab=50), True, "vocabulary"),
        (vllm_config(is_multimodal_model=True), True, "multimodal"),
    ]:
        ok, reason = deployment.zero_cost_fallback_for(cfg, enabled)
        assert not ok and why in reason, (reason, why)
    for runner in ("cpu-v2", "gpu-v1", "gpu-v2", "other"):
        monkeypatch.setattr(runners, "model_runner_name", lambda cfg, r=runner: r)
        assert "CPU V1 model runner only" in deployment.zero_cost_fallback_for(vllm_config(), True)[1]


def test_the_plugin_config_flag_is_read_from_additional_config(monkeypatch):
    monkeypatch.setattr(runners, "model_runner_name", lambda cfg: "cpu-v1")
    cfg = vllm_config()
    assert deployment.plugin_zero_cost_fallback(cfg)[0]
    cfg.additional_config = {"specplug": {"zero_cost_fallback": False}}
    assert not deployment.plugin_zero_cost_fallback(cfg)[0]
    cfg.additional_config = {"specplug": {"nope": 1}}
    ok, why = deployment.plugin_zero_cost_fallback(cfg)
    assert not ok and "plugin config unavailable" in why


def test_a_subclass_of_the_plugin_scheduler_counts_as_the_plugins():
    class Mine(SimpleNamespace):
        pass

    Mine.__module__ = "vllm_specplug.scheduler"
    cfg = vllm_config(scheduler=type("UserScheduler", (Mine,), {"__module__": "user.mod"}))
    assert deployment.uses_plugin_scheduler(cfg)
    assert not deployment.uses_plugin_scheduler(vllm_config(scheduler=None))


def _imports(path: Path) -> set[str]:
    """Every vllm_specplug module a file imports, at any level (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("vllm_specplug")}


@pytest.mark.parametrize("module", ["plugin.py", "deployment.py", "compat.py", "config.py",
                                    "patches/__init__.py", "patches/draft_model_skip.py",
                                    "patches/draft_catchup.py", "patches/kernel_override_scan.py"])
def test_the_import_graph_runs_one_way(module):
    # plugin -> patches -> {deployment, config, compat}; only the scheduler
    # (and what the engine core runs) imports the scheduler.
    bad = {m for m in _imports(PKG / module)
           if m.startswith(("vllm_specplug.scheduler", "vllm_specplug.plugin"))
           and not module.startswith("plugin")}
    assert not bad, bad
    if module != "config.py":  # config builds the controller's settings
        assert not {m for m in _imports(PKG / module) if ".controller" in m}


def test_the_runtime_imports_nothing_from_tools():
    """The server side (every module outside ``tools/``) imports nothing that only
    tools use: benchmarks, the simulator, reports and test helpers live in ``tools/``."""
    runtime = [p for p in PKG.rglob("*.py") if "tools" not in p.relative_to(PKG).parts]
    assert len(runtime) > 30
    bad = {str(p.relative_to(PKG)): sorted(m for m in _imports(p) if m.startswith(
        "vllm_specplug.tools")) for p in runtime}
    assert not {k: v for k, v in bad.items() if v}


def test_vllms_adaptive_verification_leaves_k_to_vllm(monkeypatch):
    """One controller per K: with vLLM's adaptive verification on, the plugin
    is inert; the reason names the setting and never asks for the V1 runner."""
    cfg = vllm_config()
    assert deployment.runner_refusal(cfg) is None
    cfg.speculative_config.enable_adaptive_verification = True
    why = deployment.runner_refusal(cfg)
    assert "enable_adaptive_verification" in why and "VLLM_USE_V2_MODEL_RUNNER" not in why


def test_one_deployment_settles_every_fact_once(monkeypatch):
    """``Deployment.settle``: runner, method, K, the plugin config (validated),
    why inert, why K_step is pinned, zero-cost and confidence eligibility."""
    from vllm_specplug.config import SpecPlugConfigError
    from vllm_specplug.deployment import Deployment

    monkeypatch.setattr(runners, "model_runner_name", lambda cfg: "cpu-v1")
    cfg = vllm_config()
    cfg.parallel_config.tensor_parallel_size = 1
    dep = Deployment.settle(cfg)
    assert (dep.method, dep.num_spec_tokens, dep.inert, dep.pin_reason) == (
        "draft_model", 4, None, None)
    assert dep.zero_cost and dep.confidence_stop(is_async=False)
    assert not dep.confidence_stop(is_async=True)
    off = dep.with_config(cfg, dep.config.__class__.from_dict(
        {"zero_cost_fallback": False, "draft_confidence": False}, 4))
    assert not off.zero_cost and "off in the plugin config" in off.zero_cost_why
    assert not off.confidence_stop(is_async=False)
    lockstep = Deployment.settle(vllm_config(dp=2))
    assert "data_parallel_size" in lockstep.pin_reason and not lockstep.zero_cost
    none = vllm_config()
    none.speculative_config = None
    assert "no speculative config" in Deployment.settle(none).inert
    bad = vllm_config()
    bad.additional_config = {"specplug": {"polcy": "static"}}
    with pytest.raises(SpecPlugConfigError, match="polcy"):
        Deployment.settle(bad)


@pytest.mark.parametrize("runner,version,pinned", [
    ("cpu-v1", "0.32.0", False), ("gpu-v1", "0.33.0", False),
    ("gpu-v2", "0.32.0", True), ("gpu-v2", "0.33.0", True), ("gpu-v2", "0.34.0", False)])
def test_k_step_is_pinned_where_the_drafter_runs_every_position(monkeypatch, runner, version,
                                                                 pinned):
    """draft_model: vLLM 0.32-0.33's V2 speculator drafts every position
    whatever K_step says (the plugin adapts each request's k under the full
    K); V1, and 0.34's autoregressive speculator, draft K_step positions."""
    from types import SimpleNamespace

    from vllm_specplug import compat, runners
    from vllm_specplug.deployment import pin_reason

    monkeypatch.setattr(runners, "model_runner_name", lambda vllm_config: runner)
    monkeypatch.setattr(compat, "vllm_version", lambda: version)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"),
                          parallel_config=SimpleNamespace(data_parallel_size=1))
    why = pin_reason(cfg)
    assert (why is not None) == pinned, why
    if pinned:
        assert "drafts every position" in why


def test_a_users_batch_size_table_of_k_pins_k_step(monkeypatch):
    from types import SimpleNamespace

    from vllm_specplug import runners
    from vllm_specplug.deployment import pin_reason

    monkeypatch.setattr(runners, "model_runner_name", lambda vllm_config: "cpu-v1")

    def config(table=None, method="draft_model"):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(
                method=method, num_speculative_tokens_per_batch_size=table),
            parallel_config=SimpleNamespace(data_parallel_size=1))

    assert pin_reason(config()) is None
    assert "per_batch_size" in pin_reason(config([(1, 8, 4), (9, 64, 2)]))
    assert "needs a fixed K" in pin_reason(config(method="mtp"))
