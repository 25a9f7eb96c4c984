"""The adaptive-K controller: plain Python and NumPy, no vLLM import.

Its per-step loops are compiled with numba when it is installed (see
``compiled``); the NumPy paths are the fallback and the reference.
"""

from vllm_specplug.controller.controller import (
    ControllerSettings,
    ControllerStats,
    SpecController,
)
from vllm_specplug.controller.cost_model import CostPrior, StepCostModel
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.policy import (
    Decision,
    GoodputPolicy,
    HeuristicPolicy,
    StaticPolicy,
)

__all__ = [
    "AcceptanceEstimator",
    "ControllerSettings",
    "ControllerStats",
    "CostPrior",
    "Decision",
    "GoodputPolicy",
    "HeuristicPolicy",
    "SpecController",
    "StaticPolicy",
    "StepCostModel",
]
