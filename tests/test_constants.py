"""The decision constants: the code, docs/internals.md's table and the README agree.

``docs/internals.md`` ("Constants that shape decisions") gives every number the
controller, the start-up measurement and the config decide with, where it lives
and what measured it.  Here each row's ``where`` names are resolved in the code
(module constants, class constants, settings defaults, constructor defaults) and
each value must be among the numbers its ``value`` cell states (a ``Class(kw=v)``
in ``where`` states its own); every upper-case number the decision modules name
must have a row; and the README's config table gives the config's defaults.  A
value changed on one side only fails here.
"""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = [f"vllm_specplug.controller.{m}" for m in (
    "settings", "estimator", "estimator_kernels", "policy", "pricing", "argmax", "baselines",
    "confidence", "probes", "controller", "profile", "correction", "horizon")] + [
    f"vllm_specplug.profiling.{m}" for m in ("rounds", "testbench", "validation", "keys")] + [
    "vllm_specplug.config"]
NUMBER = re.compile(r"(?<![\w.])[-+x]?(\d[\d,]*\.?\d*(?:e-?\d+)?)(%?)")


def is_number(v) -> bool:
    return isinstance(v, (int, float, np.ndarray)) and not isinstance(v, bool)


def code_constants() -> dict:
    """Name -> value: ``NAME`` and ``Class.NAME`` for upper-case numbers,
    ``Class.field`` for dataclass defaults, ``Class.kw`` for keyword defaults
    of a class's ``__init__``."""
    out = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        for key, v in vars(mod).items():
            if key.isupper() and is_number(v):
                out[key] = v
            if not (inspect.isclass(v) and v.__module__ == name):
                continue
            for attr, w in vars(v).items():
                if attr.isupper() and is_number(w):
                    out[f"{key}.{attr}"] = out.setdefault(attr, w)
            if dataclasses.is_dataclass(v):
                for f in dataclasses.fields(v):
                    if is_number(f.default):
                        out[f"{key}.{f.name}"] = f.default
            if "__init__" in vars(v):
                for p in inspect.signature(v.__init__).parameters.values():
                    if is_number(p.default):
                        out.setdefault(f"{key}.{p.name}", p.default)
    return out


def numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) / (100 if pct else 1) for n, pct in NUMBER.findall(text)]


def table_rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## Constants that shape decisions", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and line.startswith("| ") and cells[1] != "constant":
            rows.append((cells[1], cells[2], cells[3]))
    return rows


def same(a, b) -> bool:
    return np.allclose(np.atleast_1d(np.asarray(a, dtype=float)), np.asarray(b, dtype=float),
                       rtol=1e-12, atol=0)


def test_every_value_the_table_names_is_the_codes():
    code = code_constants()
    checked = 0
    for constant, where, value in table_rows():
        for name in re.findall(r"`([^`]+)`", where):
            ctor = re.fullmatch(r"(\w+)\((.*)\)", name)
            if ctor:  # ``Class(kw=v, ...)``: the defaults the cell states
                for kw, v in re.findall(r"(\w+)=([\d.e-]+)", ctor.group(2)):
                    assert same(code[f"{ctor.group(1)}.{kw}"], float(v)), (constant, name)
                    checked += 1
                continue
            if name not in code:
                continue
            stated = numbers(value)
            want = np.atleast_1d(code[name]).astype(float)
            assert all(any(same(w, s) for s in stated) for w in want), (
                f"docs/internals.md row {constant!r}: {name} is {code[name]} in the code, "
                f"the table says {value!r}")
            checked += 1
    assert checked >= 40, checked  # the table is read, not skipped


def test_every_named_decision_number_has_a_row():
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## Constants that shape decisions", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`(]+)", section))
    named |= {n.split(".")[-1] for n in named}
    missing = sorted(n for n in code_constants() if "." not in n and n not in named)
    assert not missing, f"decision constants without a row in docs/internals.md: {missing}"


def readme_defaults() -> dict[str, str]:
    out = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`"):
            keys = re.findall(r"`(\w+)`", cells[1])
            vals = [v.strip() for v in cells[2].split(",")]
            if len(keys) == len(vals):
                out.update(zip(keys, vals))
    return out


@pytest.mark.parametrize("key", ["min_gain", "forgetting", "prior_strength",
                                 "initial_acceptance", "probe_k", "probe_interval",
                                 "probe_max_interval", "log_interval_s", "policy",
                                 "profile_correction", "profile"])
def test_the_readme_gives_the_configs_default(key):
    from vllm_specplug.config import SpecPlugConfig

    default = {f.name: f.default for f in dataclasses.fields(SpecPlugConfig)}[key]
    stated = readme_defaults()[key]
    if isinstance(default, bool):
        assert stated == str(default).lower(), (key, stated, default)
    elif isinstance(default, str):
        assert stated == f"`{default}`", (key, stated, default)
    else:
        assert float(stated) == default, (key, stated, default)
