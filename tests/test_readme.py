"""The README's commands, as written.

Every shell command in the README's indented blocks is extracted.  The cheap
ones run to the end (``models list``, ``models path``, ``data list``); every other one is
checked as far as it can be without minutes of work: its program and
subcommand exist and accept ``--help``, the files it names exist, ``make``
targets are in the Makefile, and the extras ``pip install`` names are in
setup.py.  The long ones (``make demo``, ``models fetch``, ``serve``) were run
by hand; the README's results say when.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def commands() -> list[str]:
    out, block = [], []
    for line in README.splitlines() + [""]:
        if line.startswith("    ") and line.strip():
            block.append(line[4:])
            continue
        text = "\n".join(block).replace("\\\n", " ")
        block = []
        for cmd in text.splitlines():
            cmd = cmd.split("  #", 1)[0].strip()
            if re.match(r"(make |pip |python |vllm-specplug \w|VLLM_\w+=)", cmd):
                out.append(cmd)
    # Commands quoted in the text.
    for cmd in re.findall(r"`((?:VLLM_\w+=\S+ )*(?:vllm-specplug \w|python -m )[^`]*)`", README):
        if cmd not in out:
            out.append(cmd)
    return out


CMDS = commands()


def test_the_readme_has_the_two_commands_and_the_ways_to_start():
    assert "make demo" in CMDS and "make test" in CMDS
    assert any(c.startswith("vllm-specplug serve --config configs/") for c in CMDS)


def _argv(cmd: str) -> list[str]:
    argv = shlex.split(cmd)
    while argv and re.match(r"\w+=", argv[0]):
        argv.pop(0)  # environment assignments
    return argv


@pytest.mark.parametrize("cmd", CMDS)
def test_readme_command(cmd, tmp_path):
    argv = _argv(cmd)
    for word in argv:
        if re.match(r"(configs|examples|benchmarks|tests|docs)/", word):
            assert (ROOT / word).exists(), word
    if argv[0] == "make":
        assert re.search(rf"^{argv[1]}:", (ROOT / "Makefile").read_text(), re.M), cmd
        return
    if argv[0] == "pip":
        extra = re.search(r"\[(\w+)\]", argv[-1]).group(1)
        assert f'"{extra}":' in (ROOT / "setup.py").read_text(), cmd
        return
    exe = [str(BIN / "vllm-specplug")] if argv[0] == "vllm-specplug" else [sys.executable]
    rest = argv[1:]
    from vllm_specplug.tools.models import MODELS

    if rest[:2] in (["models", "list"], ["data", "list"]):
        r = subprocess.run(exe + rest, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip(), cmd
        return
    if rest[:2] == ["models", "path"] and rest[2] in MODELS:
        _check_models_path(exe + rest, rest[2], tmp_path)
        return
    # Long commands: the program and its subcommand take --help.
    if exe[0] == sys.executable:
        head = rest[:2]  # -m module
    elif rest[0] in ("models", "trace", "data"):
        head = rest[:2]
    else:
        head = rest[:1]
    key = tuple(exe + head)
    if key not in _HELP:
        _HELP[key] = subprocess.run(exe + head + ["--help"], capture_output=True, text=True,
                                    timeout=300, cwd=ROOT)
    r = _HELP[key]
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])


_HELP: dict[tuple, subprocess.CompletedProcess] = {}


def _check_models_path(argv: list[str], key: str, cache) -> None:
    """``models path KEY`` in a private cache: before the fetch, exit 1 naming the
    fetch command; once the model is there, its folder.  Whatever this machine's
    own cache holds, both answers are checked."""
    import os

    from vllm_specplug.tools.models import model_path

    env = {**os.environ, "VLLM_SPECPLUG_CACHE": str(cache)}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"fetch {key}" in r.stderr, r.stderr
    folder = model_path(key, cache)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # the file a finished fetch leaves
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(folder), r.stdout
