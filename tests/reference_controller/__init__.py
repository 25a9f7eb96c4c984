"""Test-only snapshot of vllm_specplug.controller before the decision-cost rewrite (issue 49): the reference every new decision must match."""

from reference_controller.controller import (
    ControllerSettings,
    ControllerStats,
    SpecController,
)
from reference_controller.estimator import AcceptanceEstimator
from reference_controller.policy import (
    Decision,
    GoodputPolicy,
    HeuristicPolicy,
    StaticPolicy,
    StepPricer,
)
from reference_controller.profile import (
    ProfileCorrection,
    StepProfile,
    prior_profile,
)

__all__ = [
    "AcceptanceEstimator",
    "ControllerSettings",
    "ControllerStats",
    "Decision",
    "GoodputPolicy",
    "HeuristicPolicy",
    "ProfileCorrection",
    "SpecController",
    "StaticPolicy",
    "StepPricer",
    "StepProfile",
    "prior_profile",
]
