"""The scheduler's side of the zero-cost fallback (``patches/draft_model_skip.py``).

The worker skips the draft model at K_step = 0 and catches it up before the
next K_step > 0; the worker keeps the exact stale-block state.  Here, per
request whose draft skipped steps, the first position it skipped, so the
controller can price the catch-up (``deployment.catch_up_tokens``), and the
catch-up each step still in flight carries, for the step's timing.  Each
step's output says whether the workers actually skip (``worker_reports``).
"""

from __future__ import annotations

import logging

from vllm_specplug.deployment import catch_up_tokens

logger = logging.getLogger("vllm.specplug")


class ZeroCostBook:
    """Whether the workers skip the draft at K_step = 0, and the catch-ups owed."""

    def __init__(self, on: bool, block_size: int) -> None:
        self.on = on
        self.block_size = block_size
        # Per request whose draft skipped steps, the first position it skipped.
        self.stale_from: dict[str, int] = {}
        # Catch-up tokens per SchedulerOutput still in flight (by id).
        self.catchup: dict[int, int] = {}

    def owed(self, requests, scheduled: dict[str, int]) -> tuple[int, int | None]:
        """This step's catch-up tokens, and what would be pending a step later
        if this one skipped the draft (None when the workers do not skip)."""
        stale = self.stale_from
        catchup = 0
        if stale:
            # num_computed_tokens already counts this step's tokens.
            catchup = sum(catch_up_tokens(stale[rid], requests[rid].num_computed_tokens - n,
                                          self.block_size)
                          for rid, n in scheduled.items() if rid in stale)
        if_plain = (sum(self._if_plain(requests[rid], n) for rid, n in scheduled.items())
                    if self.on else None)
        return catchup, if_plain

    def _if_plain(self, request, n: int) -> int:
        """A request's catch-up tokens pending a step later if this step (``n`` of
        its tokens) skipped the draft.

        Tokens of its prompt add nothing: a request the draft has not yet
        drafted for owes its prompt's pass only if it drafts at all, and
        whether it will is what the plan is deciding.  Charging a plain step
        the prompt's catch-up while a drafting one pays the prompt's pass
        cancelled the two, so the pass over a new prompt never counted
        against drafting (served, the draft's prompt pass cost 1.2-1.5x
        plain's time to first token at 4 and 8 requests for a decoding gain
        near zero)."""
        computed = request.num_computed_tokens
        before = computed - n
        start = self.stale_from.get(request.request_id)
        if before < request.num_prompt_tokens:
            # Its prompt is in this step: what it owes stays what it owes.
            return 0 if start is None else catch_up_tokens(start, before, self.block_size)
        return catch_up_tokens(before if start is None else start, computed, self.block_size)

    def planned(self, key: int, k_step: int, requests, scheduled: dict[str, int],
                catchup: int) -> None:
        """The step ``key`` was sent with ``k_step``: mark who skips, or who catches up."""
        if not self.on:
            return
        stale = self.stale_from
        if k_step == 0:
            for rid, n in scheduled.items():
                if rid not in stale:
                    stale[rid] = requests[rid].num_computed_tokens - n
        elif stale:
            for rid in scheduled:
                stale.pop(rid, None)
            if catchup:
                self.catchup[key] = catchup

    def take_catchup(self, key: int) -> int:
        return self.catchup.pop(key, 0)

    def worker_reports(self, on: bool, allowed: bool, controller, fresh_profile):
        """The workers' zero-cost state, as the step's output reports it (rank 0's).

        A worker that gave up skipping (a failed catch-up) runs the draft's
        first pass at K_step = 0 from then on: K_step = 0 steps are priced
        with that pass and no catch-up is owed.  Requests that skipped steps
        before draft from KV the catch-up never repaired, so what was learnt
        of their acceptance no longer holds: it starts again from the pool.
        ``allowed`` is whether the deployment lets workers skip at all;
        ``fresh_profile()`` builds the profile for skipping workers.  Returns
        the controller's new profile, or None where nothing changed.
        """
        if on == self.on or (on and not allowed):
            return None
        self.on = on
        if on:
            profile = fresh_profile()
            controller.set_profile(profile)
            logger.info("vllm-specplug: the workers skip the draft at K_step = 0 again")
            return profile
        # The profile in use was the skipping one: its first pass now runs at K_step = 0 too.
        profile = controller.profile.with_first_pass_at_k0()
        controller.set_profile(profile)
        cold = list(self.stale_from)
        controller.forget_acceptance(cold)
        self.stale_from.clear()
        self.catchup.clear()
        logger.warning("vllm-specplug: a worker reports the zero-cost fallback off (its "
                       "catch-up failed; see its log): K_step = 0 steps are priced with the "
                       "draft's first pass, and %d requests that skipped steps learn their "
                       "acceptance anew", len(cold))
        return profile
