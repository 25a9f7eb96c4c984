"""The adaptive-K controller: plain Python, NumPy and a few numba kernels; no vLLM import."""

from vllm_specplug.controller.baselines import HeuristicPolicy, StaticPolicy
from vllm_specplug.controller.controller import SpecController, warm_up
from vllm_specplug.controller.correction import ProfileCorrection
from vllm_specplug.controller.estimator import AcceptanceEstimator
from vllm_specplug.controller.policy import GoodputPolicy
from vllm_specplug.controller.pricing import Decision, StepPricer
from vllm_specplug.controller.profile import UNKNOWN_DRAFT_RATIO, StepProfile, prior_profile
from vllm_specplug.controller.settings import ControllerSettings, ControllerStats

__all__ = [
    "UNKNOWN_DRAFT_RATIO",
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
    "warm_up",
]
