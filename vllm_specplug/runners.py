"""One adapter per vLLM model runner: what the scheduler must know of the workers' runner.

The scheduler (engine-core process) never sees the workers' runner, but vLLM
picks it from the config alone, so the adapter is settled at start-up from
``vllm_config`` and the installed vLLM.  The scheduler asks it four things:

- ``index(output)``: request id -> row of ``ModelRunnerOutput.sampled_token_ids``;
- ``real_drafts(spec, is_async)``: how many of a request's scheduled drafts
  are real (verified against a draft the proposer made);
- ``drafter_follows_k_step(method)``: whether the proposer runs only
  ``num_spec_tokens_to_schedule`` positions (a smaller K_step saves draft
  work); where it does not, the plugin keeps K_step at
  ``num_speculative_tokens`` and adapts each request's k under it;
- ``worker_patches``: whether the plugin's worker patches (the zero-cost
  fallback and the draft-confidence stop) exist for this runner.

Config only: no worker module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


# Proposers that draft only K_step positions (checked against source; see
# ``RunnerAdapter.drafter_follows_k_step``).  V1's others (suffix, ngram_gpu,
# medusa, mtp) assert K_step == num_speculative_tokens.
V1_K_STEP_METHODS = frozenset({"ngram", "draft_model", "eagle", "eagle3"})
V2_K_STEP_METHODS = frozenset({"eagle", "eagle3", "mtp"})  # 0.32-0.33
V2_K_STEP_METHODS_034 = frozenset({"draft_model", "eagle", "eagle3", "mtp"})


def _version_tuple(version: str | None) -> tuple[int, int]:
    try:
        major, minor = (version or "").split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
    except ValueError:
        return (0, 0)


@dataclass(frozen=True)
class RunnerAdapter:
    """The workers' model runner, as the scheduler must treat it."""

    name: str  # "cpu-v1", "gpu-v1", "cpu-v2", "gpu-v2" or "other"
    vllm_version: str | None = None

    @property
    def is_v2(self) -> bool:
        return self.name.endswith("-v2")

    @property
    def supported(self) -> bool:
        return self.name != "other"

    @property
    def worker_patches(self) -> bool:
        """The zero-cost fallback and the confidence stop patch V1's CPU proposer only."""
        return self.name == "cpu-v1"

    def index(self, output) -> dict[str, int]:
        """Request id -> row of the output's per-request lists.

        vLLM 0.34 dropped ``ModelRunnerOutput.req_id_to_index`` (it builds the
        index from ``req_ids``); 0.32-0.33 carry both."""
        index = getattr(output, "req_id_to_index", None)
        if index is not None:
            return index
        return {rid: i for i, rid in enumerate(output.req_ids or ())}

    def real_drafts(self, spec: list[int], is_async: bool) -> int:
        """Drafts of a request's ``scheduled_spec_decode_tokens`` entry that were proposed.

        V1, synchronous: a list starting with -1 is vLLM's padding (no draft
        behind it).  Async scheduling, and the V2 runner in either mode,
        send -1 placeholders that the worker fills with its own drafts
        (``DraftTokensHandler``): each one is a real draft.
        """
        if spec and spec[0] == -1 and not is_async and not self.is_v2:
            return 0
        return len(spec)

    def drafter_follows_k_step(self, method: str | None) -> bool:
        """Whether the proposer runs only K_step positions (checked against source).

        V1: ``draft_model``, ``ngram``, ``eagle``, ``eagle3`` take
        ``num_speculative_tokens`` from the scheduler output; the others assert
        the full K.  V2 (``v1/worker/gpu/spec_decode/``): in 0.32-0.33 the
        standalone ``draft_model`` speculator (``standalone_ar``) and the n-gram
        speculator run every position whatever K_step says (the runner masks
        the tail with -1); EAGLE and MTP (``target_dependent_ar``) loop over the
        step's K.  From 0.34 ``draft_model``, EAGLE and MTP share the
        ``autoregressive`` speculator, whose loop runs the step's K (a FULL
        CUDA graph captured without vLLM's K table still replays the whole
        loop); n-gram and suffix still draft every position.
        """
        if not self.is_v2:
            return method in V1_K_STEP_METHODS
        if _version_tuple(self.vllm_version) >= (0, 34):
            return method in V2_K_STEP_METHODS_034
        return method in V2_K_STEP_METHODS


def model_runner_name(vllm_config) -> str:
    """The workers' model runner: ``"cpu-v1"``, ``"gpu-v1"``, ``"cpu-v2"``, ``"gpu-v2"`` or ``"other"``.

    vLLM picks it from the config alone: ``VllmConfig.use_v2_model_runner``
    (0.32-0.33, read by the CPU and CUDA workers); vLLM 0.34 removed the V1
    runner and the attribute with it, so its absence means V2.
    """
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            device = "cpu"
        elif current_platform.is_cuda_alike():
            device = "gpu"
        else:
            return "other"
    except Exception:
        return "other"
    try:
        from vllm.config import VllmConfig

        if hasattr(VllmConfig, "use_v2_model_runner"):  # 0.32-0.33: V1 or V2
            v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
        else:  # 0.34 on: V2 only
            v2 = True
    except Exception:
        return "other"
    return f"{device}-{'v2' if v2 else 'v1'}"


def runner_for(vllm_config) -> RunnerAdapter:
    from vllm_specplug.compat import vllm_version

    return RunnerAdapter(model_runner_name(vllm_config), vllm_version())
