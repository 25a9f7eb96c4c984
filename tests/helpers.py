"""Helpers only the tests use: prompts over the tiny models' words, the
small-vocabulary models of the sampling tests, a free loopback port.

The tiny models themselves, the engine-free scheduler driver and what runs in
vLLM's workers stay in ``vllm_specplug.tools.testing`` (the benchmarks and
vLLM's worker processes import them from there).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from vllm_specplug.tools.testing import SPECIALS, VOCAB_WORDS, build_llama, build_tokenizer, word


def prompt(i: int, length: int = 12) -> str:
    """A deterministic prompt of ``length`` words."""
    return " ".join(word((i * 37 + j * 11) % VOCAB_WORDS) for j in range(length))


def repetitive_prompt(i: int, period: int = 4, repeats: int = 6) -> str:
    """A prompt that repeats a short phrase: n-gram lookup drafts well on it."""
    phrase = [word((i * 13 + j * 7) % VOCAB_WORDS) for j in range(period)]
    return " ".join(phrase * repeats)


def make_small_vocab_models(root: str | os.PathLike, n_words: int = 8) -> dict[str, str]:
    """A target and a draft over ``n_words`` words, for sampling statistics.

    Larger weights than the other tiny models give peaked next-token
    distributions, so a biased sampler is detectable with a few thousand
    samples; the draft has other weights (its proposals are often rejected,
    which exercises rejection sampling).
    """
    root = Path(root)
    paths = {name: root / name for name in ("small_target", "small_draft")}
    done = root / ".complete"
    if not done.exists():
        for name, seed in (("small_target", 10), ("small_draft", 11)):
            paths[name].mkdir(parents=True, exist_ok=True)
            build_tokenizer(paths[name], n_words)
            build_llama(paths[name], seed, n_words + len(SPECIALS), layers=1, scale=0.5)
        done.write_text("ok")
    return {k: str(v) for k, v in paths.items()}




def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
