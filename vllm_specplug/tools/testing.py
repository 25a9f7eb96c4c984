"""Tiny models made offline in seconds, for tests and smoke runs.

``make_tiny_models(folder)`` writes:

- ``target``: a small random Llama with a word-level tokenizer built locally;
- ``draft_bad``: the same architecture and tokenizer, other random weights,
  so its drafts almost never agree with the target (acceptance ~0);
- ``draft_mismatch``: a draft whose vocabulary differs (for error tests).

The target used as its own draft gives acceptance ~1.

``make_successor_models(folder)`` writes models whose greedy output is known
in advance (each token is followed by ``successor[token]``), for tests that
need easy and hard requests side by side:

- ``copy_target``: words 0-299 form cycles of 6 (text that repeats, so
  n-gram lookup and a good draft predict it), words 300-999 one long cycle;
- ``copy_draft_half``: agrees with the target on the short cycles only, so
  its acceptance is ~1 on ``easy_prompt`` requests and ~0 on ``hard_prompt``.

``build_scheduler``, ``make_request`` and ``FakeEngine`` run vLLM's
scheduler (or the plugin's) with a synthetic model and no engine
(``benchmarks/adapter_cost.py`` and the scheduler-level tests);
``worker_draft_stats`` runs in vLLM's worker processes, which import it from
here.  What only the tests use is in ``tests/helpers.py``.

Nothing is fetched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

VOCAB_WORDS = 1000
SPECIALS = ["<unk>", "<s>", "</s>"]


def word(i: int) -> str:
    return f"w{i}"


def build_tokenizer(folder: Path, n_words: int = VOCAB_WORDS) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(n_words):
        vocab[word(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    fast.save_pretrained(str(folder))


def build_llama(folder: Path, seed: int, vocab_size: int, layers: int = 2,
                scale: float = 0.08) -> None:
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
                p.normal_(0.0, scale)
    model.save_pretrained(str(folder), safe_serialization=True)
    # Never emit EOS by accident in tests that want full-length outputs:
    # generation stops on max_tokens unless a test asks otherwise.
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(gen))


SHORT_CYCLE = 6
SHORT_WORDS = 300


def _word_id(word: int) -> int:
    return word + len(SPECIALS)


def successor_table(seed: int = 0, shuffle_long: int | None = None):
    """``succ[token_id]``: the token a successor model emits after it.

    Words below ``SHORT_WORDS`` form cycles of ``SHORT_CYCLE``; the rest one
    long cycle in an order drawn from ``seed`` (a draft built with another
    ``shuffle_long`` seed disagrees there).  Specials map among themselves
    and are never emitted after a word.
    """
    import numpy as np

    vocab = VOCAB_WORDS + len(SPECIALS)
    succ = np.arange(vocab)
    succ[[0, 1, 2]] = [1, 2, 0]
    for start in range(0, SHORT_WORDS, SHORT_CYCLE):
        ids = [_word_id(w) for w in range(start, start + SHORT_CYCLE)]
        for a, b in zip(ids, ids[1:] + ids[:1]):
            succ[a] = b
    rng = np.random.default_rng(seed if shuffle_long is None else shuffle_long)
    order = [_word_id(w) for w in rng.permutation(np.arange(SHORT_WORDS, VOCAB_WORDS))]
    for a, b in zip(order, order[1:] + order[:1]):
        succ[a] = b
    return succ


def build_successor_llama(folder: Path, succ, hidden: int = 128, layers: int = 1,
                          intermediate: int = 256, seed: int = 0) -> None:
    """A Llama whose greedy next token is ``succ[current token]``.

    Attention and MLP outputs are zero, so each position's final hidden state
    is its own (normalised) embedding ``e_t``; the output row of token
    ``succ[t]`` is ``e_t``, so that token has the largest logit.  Random unit
    embeddings in 128 or more dimensions overlap far less than they match
    (margin > 0.4), so the choice is robust in float32.  The zeroed layers
    still compute, so ``layers`` and ``intermediate`` set what a forward
    pass costs (a target heavy enough that verifying a token is not free).
    """
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(succ)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((vocab, hidden))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros_like(emb)
    head[succ] = emb  # succ is a permutation: every row is set once
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(emb).float())
        model.lm_head.weight.copy_(torch.from_numpy(head).float())
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def make_successor_models(root: str | os.PathLike) -> dict[str, str]:
    root = Path(root)
    paths = {name: root / name for name in ("copy_target", "copy_draft_half")}
    done = root / ".complete"
    if not done.exists():
        # The target costs about as much per token as the 1-2 layer random
        # target of make_tiny_models does per step, so verifying a draft
        # token has a visible price on CPU; the draft is small and cheap.
        for name, shuffle, size in (("copy_target", None, dict(hidden=512, layers=4,
                                                                 intermediate=4096)),
                                    ("copy_draft_half", 12345, {})):
            paths[name].mkdir(parents=True, exist_ok=True)
            build_tokenizer(paths[name])
            build_successor_llama(paths[name], successor_table(0, shuffle), **size)
        done.write_text("ok")
    return {k: str(v) for k, v in paths.items()}


def easy_prompt(i: int, repeats: int = 5) -> str:
    """A short cycle written out ``repeats`` times: the model continues it."""
    start = (i * SHORT_CYCLE) % SHORT_WORDS
    cycle = [word(w) for w in range(start, start + SHORT_CYCLE)]
    return " ".join(cycle * repeats)


def hard_prompt(i: int, length: int = 40) -> str:
    """Words the model will emit next, in a shuffled order, then a start word.

    The model walks the long cycle from the last word; every word it emits
    is in the prompt followed by a wrong word, so n-gram lookup proposes
    wrong drafts (and ``copy_draft_half`` disagrees there anyway).
    """
    import numpy as np

    succ = successor_table(0)
    start = _word_id(SHORT_WORDS + (i * 97) % (VOCAB_WORDS - SHORT_WORDS))
    walk, t = [], start
    for _ in range(length):
        t = int(succ[t])
        walk.append(t)
    np.random.default_rng(i).shuffle(walk)
    ids = walk + [start]
    return " ".join(word(t - len(SPECIALS)) for t in ids)


def make_tiny_models(root: str | os.PathLike) -> dict[str, str]:
    root = Path(root)
    paths = {name: root / name for name in ("target", "draft_bad", "draft_mismatch")}
    done = root / ".complete"
    if not done.exists():
        for name, seed, n_words in (("target", 0, VOCAB_WORDS), ("draft_bad", 1, VOCAB_WORDS),
                                    ("draft_mismatch", 2, VOCAB_WORDS // 2)):
            paths[name].mkdir(parents=True, exist_ok=True)
            build_tokenizer(paths[name], n_words)
            build_llama(paths[name], seed, n_words + len(SPECIALS), layers=2 if name == "target" else 1)
        done.write_text("ok")
    return {k: str(v) for k, v in paths.items()}


def shutdown_llm(llm) -> None:
    """Stop an ``LLM``'s engine core now, so the next engine can start in
    this process (tests and the demo run several, one after another)."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def worker_draft_stats(worker) -> dict:
    """Run on every worker through ``LLM.collective_rpc``: the zero-cost
    fallback's state and counters on that rank (``None`` before the first
    drafting step, ``False`` when switched off)."""
    from dataclasses import asdict

    import torch.distributed as dist

    drafter = getattr(worker.model_runner, "drafter", None)
    state = drafter.__dict__.get("_specplug_skip") if drafter is not None else None
    stats = drafter.__dict__.get("specplug_stats") if drafter is not None else None
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "zero_cost_fallback": None if state is None else bool(state),
        "stats": asdict(stats) if stats is not None else None,
    }


# -- a scheduler without an engine ------------------------------------------
# vLLM's real scheduler (or the plugin's) driven the way EngineCore drives it,
# with a synthetic model: for tests/test_scheduler_level.py and
# benchmarks/adapter_cost.py.
SAMPLED_TOKEN = 7  # every synthetic sample; the tiny vocabulary has it


def build_scheduler(model: str, k: int, *, plugin: bool = True, method: str = "draft_model",
                    async_scheduling: bool = False, specplug: dict | None = None,
                    max_model_len: int = 256, max_num_seqs: int = 16,
                    max_num_batched_tokens: int | None = None, num_blocks: int = 256,
                    block_size: int = 32, data_parallel_size: int = 1):
    """The plugin's ``AdaptiveSpecScheduler`` (``plugin=False``: vLLM's own
    ``Scheduler`` or ``AsyncScheduler``) on ``model`` with speculative decoding
    (``method``, ``k`` drafts; a ``draft_model`` drafts with ``model`` itself,
    only its config is read) and a KV cache of ``num_blocks`` blocks."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_specplug import AdaptiveSpecScheduler

    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = model
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    extra = {} if max_num_batched_tokens is None else {
        "max_num_batched_tokens": max_num_batched_tokens}
    args = EngineArgs(
        model=model, speculative_config=spec, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, block_size=block_size, enforce_eager=True,
        dtype="float32",
        # Block hashing needs the engine's hasher; prefix caching is not what
        # these drivers are about.
        enable_prefix_caching=False,
        additional_config={"specplug": specplug or {}}, **extra)
    vllm_config = args.create_engine_config()
    # CPU turns async scheduling off; the scheduler itself runs anywhere.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # What an engine core of a lockstep (MoE) DP group sees; dense DP ranks
    # are told 1 by vLLM.
    vllm_config.parallel_config.data_parallel_size = data_parallel_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["layer.0"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16,
                                           dtype=torch.float32))])
    cls = (AdaptiveSpecScheduler if plugin else
           AsyncScheduler if async_scheduling else Scheduler)
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=block_size)


def make_request(req_id: str, max_tokens: int, ceiling: int | None = None,
                 prompt_len: int = 20):
    """A greedy request that ignores EOS; ``ceiling``: its ``specplug_max_k``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = None if ceiling is None else {"specplug_max_k": ceiling}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)
    return Request(req_id, [SAMPLED_TOKEN + (i % 5) for i in range(prompt_len)], params, None)


class FakeEngine:
    """Steps a scheduler in EngineCore's order with a synthetic model.

    ``accepts``: request id -> fn(drafts offered) -> drafts accepted (clipped
    to those offered).  Each step is answered with a ``ModelRunnerOutput`` of
    that many accepted drafts plus one token; in sync mode the proposer then
    drafts ``num_spec_tokens_to_schedule`` tokens for every decoding request
    (``update_draft_token_ids``); in async mode step t+1 is scheduled before
    the output of step t is processed.  ``profile``: the plugin's step clock
    advances by its price of each step (catch-ups included), so the live
    correction sees consistent timings.  ``seconds`` holds the last step's
    ``schedule``, ``update`` (``update_from_output``) and ``drafts``
    (``update_draft_token_ids``) times.
    """

    def __init__(self, sched, accepts, profile=None) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.sched, self.accepts, self.profile = sched, accepts, profile
        self.is_async = isinstance(sched, AsyncScheduler)
        # Runner outputs shaped as this vLLM's runner makes them.
        from vllm_specplug.runners import runner_for

        self.v2 = runner_for(sched.vllm_config).is_v2
        sp = getattr(sched, "specplug", None)
        self.sp = sp if sp is not None and sp.enabled else None
        self.pending = None
        self.steps = 0
        self.now = 0.0
        self.seconds = {"schedule": 0.0, "update": 0.0, "drafts": 0.0}
        if self.sp is not None and profile is not None:
            self.sp.clock = lambda: self.now

    def model_output(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            if self.sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            a = min(max(int(self.accepts[rid](len(spec))), 0), len(spec)) if spec else 0
            sampled.append([SAMPLED_TOKEN] * (a + 1))
        shape = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM < 0.34
            shape["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**shape)

    def advance(self, so) -> None:
        """The step's time passes between its scheduling and its output."""
        if self.sp is None or self.profile is None:
            return
        k_step = so.num_spec_tokens_to_schedule
        # With zero-cost fallback a step that drafts after skipped ones first
        # catches the draft up (the adapter keeps how far, per step).
        catchup = self.sp.zero_cost.catchup.get(id(so), 0) if k_step else 0
        self.now += self.profile.step(so.total_num_scheduled_tokens,
                                      len(so.num_scheduled_tokens), k_step, catchup)

    def update(self, so, out):
        """``update_from_output`` (timed); returns its outputs."""
        self.advance(so)
        t0 = time.perf_counter()
        outputs = self.sched.update_from_output(so, out)
        self.seconds["update"] += time.perf_counter() - t0
        return outputs

    def check(self, so) -> None:
        """Called with every scheduled step, before it runs."""

    def step(self):
        """One engine step; returns its ``SchedulerOutput``."""
        from vllm.v1.outputs import DraftTokenIds

        sched = self.sched
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        t0 = time.perf_counter()
        so = sched.schedule()
        self.seconds["schedule"] = time.perf_counter() - t0
        self.check(so)
        if self.is_async:
            out = self.model_output(so) if so.total_num_scheduled_tokens else None
            if self.pending is not None:
                self.update(*self.pending)
            self.pending = (so, out) if out is not None else None
        else:
            if so.total_num_scheduled_tokens:
                self.update(so, self.model_output(so))
            k = so.num_spec_tokens_to_schedule
            if k:
                decoding = [r for r in so.num_scheduled_tokens
                            if r in sched.requests and not sched.requests[r].is_finished()]
                t0 = time.perf_counter()
                # V1 hands back the drafts; V2 keeps them on the device and
                # hands back -1 placeholders (DraftTokensHandler).
                token = -1 if self.v2 else SAMPLED_TOKEN
                sched.update_draft_token_ids(
                    DraftTokenIds(decoding, [[token] * k for _ in decoding]))
                self.seconds["drafts"] = time.perf_counter() - t0
        self.steps += 1
        return so
