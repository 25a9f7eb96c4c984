"""What the draft's pass over a prompt or a catch-up buys: the tokens the batch
has left, and the batch a new prompt will decode in.

Under the zero-cost fallback the draft's pass over what it has not seen (a
new prompt, tokens skipped in plain steps) is paid once, by the step that
drafts past it, and buys drafting for the tokens the batch has left
(``GoodputPolicy``).  Two estimates decide what it buys:

- **Tokens left** (``Horizon.left``).  ``max_tokens`` is a cap, not a length:
  served strict JSON ended at 28 tokens of 64 on average, and priced over 64
  the draft's passes over four prompts (1.3-1.8 s) looked a third as dear as
  they were.  The tokens a request has left are estimated from the lengths
  finished requests reached: the mean, over the finished requests that ran
  past the request's output so far, of the length each reached (at most the
  request's cap) less that output.  A finished request that ran to its own
  cap counts as reaching this one's; until ``MIN_LENGTHS`` requests have
  ended below their caps, and for a request longer than every one that did,
  it is the cap, as before.
- **The batch a new prompt decodes in** (``Horizon.crowd``).  Requests of a
  burst reach the scheduler over a second or so: the first is scheduled alone
  and its prompt step priced as one request's, where drafting pays, then the
  others join and the batch decodes plainly (served, eight requests a wave:
  the lone first prompt's draft pass priced 0.16-0.69 s over its plain step,
  in waves of 10-18 s, and no draft after it).  So a step whose requests are
  all new prompts, in a server that ran a larger batch within
  ``RECENT_PLANS`` plans, drafts nothing (``SpecController.plan``): the draft's pass over the
  prompts waits for the next step, which knows its batch, and is a catch-up
  there if that step drafts.  Waiting costs at most one step of drafts for
  the new requests.
"""

from __future__ import annotations

import numpy as np


class Horizon:
    """Finished requests' output lengths and the batch sizes of recent plans."""

    # Finished requests whose lengths are kept (the latest).
    # Not tuned: enough for a mean, short enough to follow a change of traffic.
    LENGTHS = 64
    # Requests that must have ended below their caps before lengths are read.
    # Not tuned: a mean of fewer moves with each request.
    MIN_LENGTHS = 8
    # Plans over which the batch sizes the server ran are remembered.
    # Source: the A/B grid at af57749 (a wave's first prompt is scheduled 1-2
    # plans after the last wave's full batch).
    RECENT_PLANS = 16

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._length = np.zeros(self.LENGTHS, dtype=np.int64)
        self._capped = np.zeros(self.LENGTHS, dtype=np.bool_)
        self._kept = 0
        self._batches = np.zeros(self.RECENT_PLANS, dtype=np.int64)
        self._plans = 0

    def ran(self, batch: int) -> None:
        """A plan of ``batch`` requests."""
        self._batches[self._plans % self.RECENT_PLANS] = batch
        self._plans += 1

    def crowd(self) -> int:
        """The largest batch planned within the last ``RECENT_PLANS`` plans."""
        return int(self._batches.max())

    def finished(self, output: int, left: int) -> None:
        """A request ended with ``output`` tokens generated and ``left`` more allowed
        at its last plan: it reached its cap when its last step could have."""
        i = self._kept % self.LENGTHS
        self._length[i] = output + 1  # its last step yields at least one token
        self._capped[i] = left <= self.max_k + 1
        self._kept += 1

    def left(self, output: np.ndarray, left: np.ndarray) -> np.ndarray:
        """Expected tokens left of requests with ``output`` tokens generated and at
        most ``left`` more (each at most ``left``, at least 1)."""
        n = min(self._kept, self.LENGTHS)
        if n - int(self._capped[:n].sum()) < self.MIN_LENGTHS:  # ended below their caps
            return left
        cap = (output + left)[:, None]
        reach = np.where(self._capped[:n], cap, np.minimum(self._length[:n], cap))
        past = reach > output[:, None]
        count = past.sum(axis=1)
        mean = np.where(past, reach, 0).sum(axis=1) / np.maximum(count, 1)
        return np.where(count > 0, np.clip(mean - output, 1, left), left)
