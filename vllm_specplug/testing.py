"""Tiny models made offline in seconds, for tests and smoke runs.

``make_tiny_models(folder)`` writes:

- ``target``: a small random Llama with a word-level tokenizer built locally;
- ``draft_bad``: the same architecture and tokenizer, other random weights,
  so its drafts almost never agree with the target (acceptance ~0);
- ``draft_mismatch``: a draft whose vocabulary differs (for error tests).

The target used as its own draft gives acceptance ~1.  Nothing is fetched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_WORDS = 1000
SPECIALS = ["<unk>", "<s>", "</s>"]


def _word(i: int) -> str:
    return f"w{i}"


def build_tokenizer(folder: Path, n_words: int = VOCAB_WORDS) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(n_words):
        vocab[_word(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    fast.save_pretrained(str(folder))


def build_llama(folder: Path, seed: int, vocab_size: int, layers: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init make greedy text less degenerate
    # (fewer immediate loops), which gives the tests real variety.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    # Never emit EOS by accident in tests that want full-length outputs:
    # generation stops on max_tokens unless a test asks otherwise.
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(gen))


def make_tiny_models(root: str | os.PathLike) -> dict[str, str]:
    root = Path(root)
    paths = {name: root / name for name in ("target", "draft_bad", "draft_mismatch")}
    done = root / ".complete"
    if not done.exists():
        vocab = VOCAB_WORDS + len(SPECIALS)
        for name, seed, n_words in (("target", 0, VOCAB_WORDS), ("draft_bad", 1, VOCAB_WORDS),
                                    ("draft_mismatch", 2, VOCAB_WORDS // 2)):
            paths[name].mkdir(parents=True, exist_ok=True)
            build_tokenizer(paths[name], n_words)
            build_llama(paths[name], seed, n_words + len(SPECIALS), layers=2 if name == "target" else 1)
        done.write_text("ok")
    return {k: str(v) for k, v in paths.items()}


def prompt(i: int, length: int = 12) -> str:
    """A deterministic prompt of ``length`` words."""
    return " ".join(_word((i * 37 + j * 11) % VOCAB_WORDS) for j in range(length))


def repetitive_prompt(i: int, period: int = 4, repeats: int = 6) -> str:
    """A prompt that repeats a short phrase: n-gram lookup drafts well on it."""
    phrase = [_word((i * 13 + j * 7) % VOCAB_WORDS) for j in range(period)]
    return " ".join(phrase * repeats)
