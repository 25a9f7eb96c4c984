"""The plugin's configuration and per-request knobs, validated once.

Server-wide settings come from ``additional_config["specplug"]`` (vLLM's
``--additional-config``); per-request settings come from
``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``), every key prefixed
``specplug_``.  Every error names the key, what was given and what is
allowed, so a typo fails at start-up instead of being silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, NamedTuple

from vllm_specplug.controller import ControllerSettings

POLICIES = ("goodput", "static", "heuristic")
# The controller's defaults are the plugin's defaults: one source of truth.
_DEFAULTS = ControllerSettings(max_k=0)
CONFIG_SECTION = "specplug"
REQUEST_PREFIX = "specplug_"


class SpecPlugConfigError(ValueError):
    """A bad plugin config value; raised at start-up."""


class SpecPlugRequestError(ValueError):
    """A bad per-request ``specplug_*`` value; rejected for that request."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class SpecPlugConfig:
    # Which policy decides K: "goodput" (adaptive, default), "static" (fixed
    # K, a baseline), "heuristic" (+2 on full acceptance, -1 otherwise).
    policy: str = "goodput"
    # Ceiling on drafts per request; defaults to num_speculative_tokens.
    max_k: int | None = None
    # K used by the static policy; defaults to the ceiling.
    static_k: int | None = None
    # Per-observation forgetting of a request's acceptance counts (0, 1].
    forgetting: float = _DEFAULTS.forgetting
    # Pseudo-trials pulling a request's estimate toward the global profile
    # (the least; the estimator raises it while live requests look alike).
    prior_strength: float = _DEFAULTS.prior_strength
    # Acceptance assumed per position before anything is observed (0, 1).
    initial_acceptance: float = _DEFAULTS.initial_acceptance
    # The step-cost profile the policy prices steps with: "auto" (the cached
    # profile of this deployment, or one measured at start-up and cached),
    # a path to a profile JSON (`vllm-specplug profile` writes one), or
    # "off" (relative prices from parameter counts, nothing measured).
    profile: str = "auto"
    # Correct the profile's prices from live step times (a clipped running
    # ratio per step shape).  False: price every step from the profile
    # alone, e.g. a profile measured offline that you trust, or a test that
    # must not depend on how fast the machine is.
    profile_correction: bool = _DEFAULTS.profile_correction
    # Relative goodput gain speculation must promise over plain decoding.
    min_gain: float = _DEFAULTS.min_gain
    # Drafts offered by a re-probe of a request in fallback.
    probe_k: int = _DEFAULTS.probe_k
    # Steps in fallback before the first re-probe; doubles after each failed
    # probe up to probe_max_interval.
    probe_interval: int = _DEFAULTS.probe_interval
    probe_max_interval: int = _DEFAULTS.probe_max_interval
    # Seconds between controller summary lines in the log (0 turns them off).
    log_interval_s: float = 10.0
    # Opt-in decision trace: a JSON Lines file the engine core appends to
    # (one line per planned and per verified step); null turns it off.
    trace_path: str | None = None
    # draft_model only: at K_step=0 the draft model does no work and catches
    # up (one prefill-like pass) before it drafts again.  Off: vLLM's path,
    # the draft's first pass runs every step.
    zero_cost_fallback: bool = True
    # draft_model with synchronous scheduling, TP=1: the draft loop stops where
    # the draft's own confidence says the next position does not pay, and only
    # the drafts worth it are verified.  Off: K from the request's history only
    # (served on the Qwen pair, 0.95-0.96 of the confidence's, benchmarks/README).
    draft_confidence: bool = True

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None, num_speculative_tokens: int
    ) -> "SpecPlugConfig":
        section = (additional_config or {}).get(CONFIG_SECTION, {})
        return cls.from_dict(section, num_speculative_tokens)

    @classmethod
    def from_dict(cls, raw: Any, num_speculative_tokens: int) -> "SpecPlugConfig":
        where = f'additional_config["{CONFIG_SECTION}"]'
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecPlugConfigError(
                f"{where} must be a JSON object, got {type(raw).__name__}: {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpecPlugConfigError(
                f"{where} has unknown key(s) {unknown}; allowed keys: {sorted(known)}")
        cfg = cls(**raw)
        cfg._validate(where, num_speculative_tokens)
        return cfg

    def _validate(self, where: str, n: int) -> None:
        def bad(key: str, allowed: str) -> SpecPlugConfigError:
            return SpecPlugConfigError(
                f"{where}.{key} = {getattr(self, key)!r} is invalid; allowed: {allowed}")

        if self.policy not in POLICIES:
            raise bad("policy", " | ".join(repr(p) for p in POLICIES))
        for key in ("max_k", "static_k"):
            v = getattr(self, key)
            if v is not None and not (_is_int(v) and 0 <= v <= n):
                raise bad(key, f"an integer from 0 to num_speculative_tokens ({n}), or null")
        if not (_is_number(self.forgetting) and 0 < self.forgetting <= 1):
            raise bad("forgetting", "a number in (0, 1]")
        if not (isinstance(self.profile, str) and self.profile.strip()):
            raise bad("profile", '"auto" | "off" | a path to a profile JSON file')
        if not (_is_number(self.initial_acceptance) and 0 < self.initial_acceptance < 1):
            raise bad("initial_acceptance", "a number in (0, 1)")
        for key in ("prior_strength", "min_gain", "log_interval_s"):
            v = getattr(self, key)
            if not (_is_number(v) and v >= 0):
                raise bad(key, "a finite number >= 0")
        if not (_is_int(self.probe_k) and 1 <= self.probe_k <= max(n, 1)):
            raise bad("probe_k", f"an integer from 1 to num_speculative_tokens ({n})")
        for key in ("probe_interval", "probe_max_interval"):
            v = getattr(self, key)
            if not (_is_int(v) and 1 <= v <= 1_000_000):
                raise bad(key, "an integer >= 1")
        if self.trace_path is not None and not (isinstance(self.trace_path, str)
                                                and self.trace_path.strip()):
            raise bad("trace_path", "a file path (string), or null")
        for key in ("zero_cost_fallback", "profile_correction", "draft_confidence"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "true | false")
        if self.probe_max_interval < self.probe_interval:
            raise bad("probe_max_interval", f"an integer >= probe_interval ({self.probe_interval})")

    def ceiling(self, num_speculative_tokens: int) -> int:
        return num_speculative_tokens if self.max_k is None else self.max_k

    def controller_settings(self, num_speculative_tokens: int) -> ControllerSettings:
        """The controller's settings for this config and vLLM's K."""
        ceiling = self.ceiling(num_speculative_tokens)
        return ControllerSettings(
            max_k=ceiling,
            policy=self.policy,
            static_k=self.static_k,
            forgetting=self.forgetting,
            prior_strength=self.prior_strength,
            initial_acceptance=self.initial_acceptance,
            min_gain=self.min_gain,
            probe_k=min(self.probe_k, max(ceiling, 1)),
            probe_interval=self.probe_interval,
            probe_max_interval=self.probe_max_interval,
            profile_correction=self.profile_correction,
        )


# -- per-request knobs ------------------------------------------------------

# Largest per-request ceiling accepted at all.  A value between the server's
# ceiling and this is clamped to the server's ceiling (a per-request ceiling
# can only lower K); anything larger is certainly a client bug.
# Not tuned: a validation bound.
MAX_REQUEST_K = 1024

REQUEST_KEYS = {
    "specplug_max_k": "per-request ceiling on drafts; 0 turns speculation off",
    "specplug_k": "exactly this many drafts every step (0: plain decoding), not the adaptive choice",
}


class RequestArgs(NamedTuple):
    """A request's own ``specplug_*`` values, clamped to the server's ceiling."""

    max_k: int | None  # its ceiling, or None: the server's
    k: int | None  # its fixed k, or None: adaptive


def _request_int(ours: Mapping[str, Any], key: str, ceiling: int) -> int | None:
    if key not in ours:
        return None
    v = ours[key]
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)  # JSON clients often send 2.0 for 2
    if not (_is_int(v) and 0 <= v <= MAX_REQUEST_K):
        raise SpecPlugRequestError(
            f"{key} = {ours[key]!r} is invalid; allowed: an integer "
            f"from 0 to {MAX_REQUEST_K} (values above the server's ceiling act as the ceiling)")
    return min(v, ceiling)


def parse_request_args(extra_args: Mapping[str, Any] | None,
                       ceiling: int = MAX_REQUEST_K) -> RequestArgs:
    """Validate a request's ``specplug_*`` extra args; return its values.

    Each value is None when the request does not set it, else clamped to
    ``ceiling`` (the server's); a fixed ``specplug_k`` is also clamped to
    the request's own ``specplug_max_k``.  Raises SpecPlugRequestError
    naming the key and the allowed values for anything invalid.
    """
    if not extra_args:
        return RequestArgs(None, None)
    ours = {k: v for k, v in extra_args.items()
            if isinstance(k, str) and k.startswith(REQUEST_PREFIX)}
    unknown = sorted(set(ours) - set(REQUEST_KEYS))
    if unknown:
        raise SpecPlugRequestError(
            f"unknown per-request key(s) {unknown}; allowed: {sorted(REQUEST_KEYS)}")
    max_k = _request_int(ours, "specplug_max_k", ceiling)
    k = _request_int(ours, "specplug_k", ceiling if max_k is None else max_k)
    return RequestArgs(max_k, k)
