"""``compat``: the start-up probe of what the plugin relies on in vLLM (no engine)."""

from types import SimpleNamespace

from vllm_specplug import compat


def test_installed_vllm_passes_the_probe():
    assert compat.probe() == []


def test_the_probe_names_a_changed_signature_and_a_missing_field(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    monkeypatch.setattr(Scheduler, "_free_request", lambda self, request: None)
    monkeypatch.delitem(ModelRunnerOutput.__dataclass_fields__, "req_ids")
    missing = compat.probe()
    assert "Scheduler._free_request(delay_free_blocks)" in missing
    assert "ModelRunnerOutput.req_ids" in missing


def test_effective_k_step_honours_skip_drafts():
    # vLLM 0.33's V2 runner drafts nothing when skip_drafts is set.
    assert compat.effective_k_step(SimpleNamespace(num_spec_tokens_to_schedule=4)) == 4
    assert compat.effective_k_step(SimpleNamespace(num_spec_tokens_to_schedule=4,
                                                   skip_drafts=True)) == 0
    assert compat.effective_k_step(SimpleNamespace(num_spec_tokens_to_schedule=None)) == 0


def test_block_hasher_arguments_follow_the_installed_signature(monkeypatch):
    from vllm.v1.core import kv_cache_utils

    cfg = SimpleNamespace(num_hash_lookahead_tokens=3)

    def hasher_032(hash_block_size, caching_hash_fn):
        return None

    monkeypatch.setattr(kv_cache_utils, "get_request_block_hasher", hasher_032)
    assert compat.block_hasher_args(cfg) == ()  # vLLM 0.32: two arguments

    def hasher_033(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens=0):
        return None

    monkeypatch.setattr(kv_cache_utils, "get_request_block_hasher", hasher_033)
    assert compat.block_hasher_args(cfg) == (3,)
    assert compat.block_hasher_args(SimpleNamespace()) == (0,)


def test_gpu_extra_pin_matches_the_checked_range():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"gpu": ["vllm{compat.SUPPORTED_RANGE}"]' in setup
