"""``vllm-specplug serve``'s argument handling, without starting a server.

Model cache keys (``model: qwen-coder-1.5b``) resolve to their cache folders
in every place a model is named; paths, hub ids and every other argument
pass through unchanged; a key not fetched yet stops with the fetch command.
"""

import json

import pytest
import yaml

from vllm_specplug.tools import models
from vllm_specplug.tools.models import resolve_model_keys


@pytest.fixture
def cache(tmp_path):
    """A model cache holding the Qwen pair (config.json is what marks a model as fetched)."""
    root = tmp_path / "cache"
    for key in ("qwen-coder-1.5b", "qwen-coder-0.5b"):
        folder = models.model_path(key, root)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    return str(root)


def test_config_keys_resolve_into_a_copy_and_the_users_file_is_untouched(cache, tmp_path):
    cfg = {"model": "qwen-coder-1.5b", "port": 8000,
           "speculative-config": {"method": "draft_model", "model": "qwen-coder-0.5b",
                                  "num_speculative_tokens": 8},
           "additional-config": {"specplug": {"policy": "goodput"}}}
    src = tmp_path / "mine.yaml"
    src.write_text(yaml.safe_dump(cfg, sort_keys=False))
    before = src.read_text()
    out_dir = tmp_path / "tmp"
    out_dir.mkdir()
    argv = resolve_model_keys(["--config", str(src), "--port", "9000"], str(out_dir), cache)
    assert argv[0] == "--config" and argv[2:] == ["--port", "9000"]
    assert argv[1] != str(src) and src.read_text() == before
    resolved = yaml.safe_load(open(argv[1]))
    assert resolved["model"] == str(models.model_path("qwen-coder-1.5b", cache))
    assert resolved["speculative-config"]["model"] == str(models.model_path("qwen-coder-0.5b", cache))
    # Everything else is kept as written, in order.
    assert list(resolved) == list(cfg)
    assert resolved["additional-config"] == cfg["additional-config"]


def test_flags_positional_and_json_resolve(cache, tmp_path):
    spec = json.dumps({"method": "draft_model", "model": "qwen-coder-0.5b",
                       "num_speculative_tokens": 4})
    argv = resolve_model_keys(["qwen-coder-1.5b", "--speculative-config", spec,
                               "--served-model-name", "qwen-coder-1.5b"], str(tmp_path), cache)
    assert argv[0] == str(models.model_path("qwen-coder-1.5b", cache))
    assert json.loads(argv[2])["model"] == str(models.model_path("qwen-coder-0.5b", cache))
    # A served name equal to a key is a name, not a model.
    assert argv[3:] == ["--served-model-name", "qwen-coder-1.5b"]
    argv = resolve_model_keys(["--model=qwen-coder-1.5b"], str(tmp_path), cache)
    assert argv == [f"--model={models.model_path('qwen-coder-1.5b', cache)}"]


def test_paths_hub_ids_and_other_configs_pass_through(cache, tmp_path):
    folder = tmp_path / "qwen-coder-1.5b"  # a folder of that name wins over the key
    folder.mkdir()
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"model": "Qwen/Qwen2.5-Coder-1.5B"}))
    argv = ["--config", str(plain), "--model", str(folder), "--port", "8000"]
    assert resolve_model_keys(argv, str(tmp_path), cache) == argv
    assert resolve_model_keys(["--config", str(tmp_path / "missing.yaml")], str(tmp_path),
                              cache) == ["--config", str(tmp_path / "missing.yaml")]


def test_a_key_not_fetched_stops_with_the_fetch_command(tmp_path):
    with pytest.raises(SystemExit) as err:
        resolve_model_keys(["--model", "smollm2-135m"], str(tmp_path), str(tmp_path / "empty"))
    assert "vllm-specplug models fetch smollm2-135m" in str(err.value)


def test_shipped_configs_name_models_by_key():
    # They run as shipped after `vllm-specplug models fetch ...`: no paths to edit.
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["model"] in models.MODELS, path.name
        spec = cfg.get("speculative-config") or {}
        if spec.get("method") == "draft_model":
            assert spec["model"] in models.MODELS, path.name
        assert "vllm-specplug serve" in path.read_text().split("\n\n")[0], path.name


def test_cpu_build_gets_a_kv_cache_size_unless_the_user_set_one(monkeypatch):
    from vllm_specplug.tools import serve

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert not serve.default_cpu_kvcache(cpu_build=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in __import__("os").environ
    assert serve.default_cpu_kvcache(cpu_build=True)
    assert __import__("os").environ["VLLM_CPU_KVCACHE_SPACE"] == serve.CPU_KVCACHE_GIB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert not serve.default_cpu_kvcache(cpu_build=True)
    assert __import__("os").environ["VLLM_CPU_KVCACHE_SPACE"] == "7"
