"""The scheduler's side of the draft-confidence stop (``patches/draft_confidence.py``).

The scheduler sends a ``StopRule`` (the controller's ``stop_rule``) once a
worker's step output says it can stop; the worker reports, per request,
the drafts worth verifying and their confidences (``DraftReport``).  The
drafts are trimmed to those, and when they are verified their confidences
and outcomes go to the controller's calibration.
"""

from __future__ import annotations


class ConfidenceStop:
    """What travels between worker and scheduler for the confidence stop."""

    def __init__(self, allowed: bool) -> None:
        # Whether this deployment may use the stop at all.
        self.allowed = allowed
        # Rules are sent once a worker's step output says it can stop (its
        # patch is installed and on): otherwise a deeper K_step would only
        # draft what is then trimmed.
        self.worker_on = False
        # Per request, from the last step's report: (drafts worth verifying,
        # their confidences); and the confidences of the drafts now offered.
        self.kept: dict[str, tuple[int, list]] = {}
        self.offered: dict[str, list] = {}

    def rule(self, controller, decision):
        """The ``StopRule`` of this step's plan ``decision``, or None where none is sent."""
        return controller.stop_rule(decision) if self.allowed and self.worker_on else None

    def worker_report(self, report) -> None:
        self.worker_on = bool(report.on)
        self.kept = report.kept

    def trim(self, planned: dict[str, int], req_ids, drafts) -> list:
        """Each request's fresh drafts cut to its k_r and to what its worker kept."""
        kept = self.kept
        trimmed = []
        for rid, ids in zip(req_ids, drafts):
            k = planned.get(rid)
            worth = kept.get(rid)
            if worth is not None:
                # The worker's stop: the drafts worth verifying, and
                # their confidences, for the calibration.
                k = worth[0] if k is None else min(k, worth[0])
                self.offered[rid] = worth[1][:k]
            else:
                self.offered.pop(rid, None)
            trimmed.append(ids[:k] if k is not None and len(ids) > k else ids)
        return trimmed
