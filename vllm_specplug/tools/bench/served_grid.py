"""The served benchmark's grid: its cells (workload, load, kind), each cell's
own prompts written out, the setups' models, and the nominal seconds the
up-front estimate and the progress bar count in."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_specplug.tools.bench.runner import resolve_model
from vllm_specplug.tools.bench.setups import SERVED_SETUPS as SETUPS, ServedSetup

JSON_INSTRUCTION = ("Describe the Python function below as a JSON object with the keys "
                    "name, args (a list of argument names) and returns (what it returns).\n\n")



@dataclass
class Cell:
    workload: str
    kind: str  # "cold", "c", "rate", "repeat"
    concurrency: int  # 0 for the rate cell
    requests: int
    path: str
    chat: bool  # the chat endpoint (the server applies the template)
    structured: bool

    @property
    def key(self) -> str:
        load = f"rate{self.concurrency}" if self.kind == "rate" else f"c{self.concurrency}"
        return f"{self.workload}/{load}/{self.kind}"


def prompt_sources(setup: ServedSetup, workload: str, tokenizer,
                   data_cache) -> tuple[list[str], bool]:
    """(prompts in their seeded order, sent to the chat endpoint?)."""
    rng = random.Random(0)
    if setup.name == "tiny":
        from vllm_specplug.tools.testing import easy_prompt, hard_prompt

        make = easy_prompt if workload == "easy" else hard_prompt
        return [make(i) for i in range(64)], False
    from vllm_specplug.tools import datasets

    def fits(text):
        return len(tokenizer(text).input_ids) <= setup.max_prompt_tokens

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)

    def sample(key, n, render=None):
        recs = datasets.load(key, data_cache)
        rng.shuffle(recs)
        out = []
        for r in recs:
            text = render(r["prompt"]) if render else r["prompt"]
            if fits(text):
                out.append(text)
                if len(out) >= n:
                    break
        return out

    if workload == "humaneval":
        return sample("humaneval", 164), False
    if workload == "sharegpt":
        # The chat endpoint renders the turn; the length filter counts it rendered.
        return [t for t in sample("sharegpt", 200)
                if fits(chat(t))], True
    if workload == "mixed":
        code, talk = sample("humaneval", 164), sample("sharegpt", 200, chat)
        return [p for pair in zip(code, talk) for p in pair], False
    if workload == "json":
        return sample("humaneval", 164, lambda p: chat(JSON_INSTRUCTION + p)), False
    raise SystemExit(f"unknown workload {workload!r}; known: humaneval, sharegpt, mixed, json")


def build_cells(setup, workloads, concurrency, with_rate, out: Path, tokenizer,
                data_cache=None, requests: int | None = None, waves: int = 2,
                cold_requests: int | None = None) -> list[Cell]:
    """Each cell's own prompts (disjoint slices, so no cell reuses another's prefix cache).
    ``requests``: a c=1 cell's requests (default the setup's); a cell at c > 1
    sends ``waves * c``; ``cold_requests``: the cold run's (default the setup's)."""
    cells = []
    single = requests or setup.requests
    for w in workloads:
        prompts, is_chat = prompt_sources(setup, w, tokenizer, data_cache)
        loads = [("c", c, single if c == 1 else waves * c) for c in concurrency]
        if with_rate and setup.rate > 0 and w == setup.rate_workload:
            loads.append(("rate", 0, 2 * max(concurrency)))
        if w == workloads[0]:
            loads.insert(0, ("cold", 1, cold_requests or setup.requests))
        at = 0
        for kind, c, n in loads:
            if at + n > len(prompts):
                raise SystemExit(f"{setup.name} {w}: {len(prompts)} prompts fit in "
                                 f"{setup.max_prompt_tokens} tokens, the grid needs {at + n}")
            path = out / "workloads" / setup.name / f"{w}-{kind}{c}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                for p in prompts[at:at + n]:
                    f.write(json.dumps({"prompt": p, "output_tokens": setup.output_tokens}) + "\n")
            at += n
            cells.append(Cell(w, kind, c, n, str(path), is_chat, w == "json"))
    first = next(c for c in cells if c.kind == "c")
    cells.append(Cell(first.workload, "repeat", first.concurrency, first.requests, first.path,
                      first.chat, first.structured))
    return cells



def setup_models(name: str, tiny_root: str) -> tuple[ServedSetup, str, str | None, object]:
    """A setup by name, its target and draft paths, and the target's tokenizer."""
    from transformers import AutoTokenizer

    if name not in SETUPS:
        raise SystemExit(f"--setups: unknown {name!r}; known: {', '.join(SETUPS)}")
    setup = SETUPS[name]
    target = resolve_model(setup.target, tiny_root)
    draft = resolve_model(setup.draft, tiny_root) if setup.draft else None
    return setup, target, draft, AutoTokenizer.from_pretrained(target)



def cell_units(setup, cell) -> float:
    """A cell's nominal seconds: the up-front estimate and the progress bar's unit."""
    c = max(cell.concurrency, 1)
    return (cell.requests * setup.output_tokens / (setup.nominal_tok_s * min(c, 3) ** 0.6)
            + cell.requests * 150 * setup.prefill_s_per_token + 3)


def estimate_s(setup, cells, arms) -> float:
    return (setup.ready_s + sum(cell_units(setup, c) for c in cells)) * len(arms)
