"""Plugin config and per-request knob validation (no vLLM engine)."""

import math

import pytest

from vllm_specplug.config import (
    MAX_REQUEST_K,
    SpecPlugConfig,
    SpecPlugConfigError,
    SpecPlugRequestError,
    parse_request_args,
)


def test_defaults_are_goodput_with_ceiling_from_vllm():
    cfg = SpecPlugConfig.from_additional_config({}, 8)
    assert cfg.policy == "goodput" and cfg.ceiling(8) == 8
    assert cfg.zero_cost_fallback and cfg.draft_confidence  # where they apply
    assert SpecPlugConfig.from_additional_config(None, 4).policy == "goodput"


@pytest.mark.parametrize("raw,key", [
    ({"policy": "fast"}, "policy"),
    ({"max_k": 9}, "max_k"),
    ({"max_k": -1}, "max_k"),
    ({"max_k": True}, "max_k"),
    ({"static_k": "4"}, "static_k"),
    ({"forgetting": 0}, "forgetting"),
    ({"forgetting": float("nan")}, "forgetting"),
    ({"initial_acceptance": 1.0}, "initial_acceptance"),
    ({"min_gain": -0.1}, "min_gain"),
    ({"probe_k": 0}, "probe_k"),
    ({"probe_interval": 0}, "probe_interval"),
    ({"probe_interval": 8, "probe_max_interval": 4}, "probe_max_interval"),
    ({"log_interval_s": math.inf}, "log_interval_s"),
    ({"profile": ""}, "profile"),
    ({"profile": 3}, "profile"),
    ({"profile_correction": "no"}, "profile_correction"),
    ({"zero_cost_fallback": 1}, "zero_cost_fallback"),
    ({"cost_forgetting": 0.99}, "cost_forgetting"),  # gone: prices come from the profile
])
def test_bad_values_name_the_key_and_allowed_values(raw, key):
    with pytest.raises(SpecPlugConfigError) as err:
        SpecPlugConfig.from_dict(raw, 8)
    msg = str(err.value)
    assert key in msg and "allowed" in msg


def test_profile_defaults_to_auto():
    assert SpecPlugConfig.from_dict({}, 8).profile == "auto"
    for value in ("off", "/tmp/profile.json"):
        assert SpecPlugConfig.from_dict({"profile": value}, 8).profile == value


def test_profile_correction_reaches_the_controller():
    from vllm_specplug.controller import SpecController

    assert SpecPlugConfig.from_dict({}, 8).controller_settings(8).profile_correction
    settings = SpecPlugConfig.from_dict({"profile_correction": False}, 8).controller_settings(8)
    ctrl = SpecController(settings)
    assert not ctrl.observe_step(1, 5, 4, 123.0)
    assert ctrl.pricer.correction.observations == 0


def test_unknown_keys_are_rejected_with_the_allowed_list():
    with pytest.raises(SpecPlugConfigError, match=r"unknown key\(s\) \['polcy'\].*policy"):
        SpecPlugConfig.from_dict({"polcy": "static"}, 8)
    with pytest.raises(SpecPlugConfigError, match="JSON object"):
        SpecPlugConfig.from_dict(["goodput"], 8)


def test_request_ceiling_parsing():
    assert parse_request_args(None, 4) == (None, None)
    assert parse_request_args({"other": 1}, 4) == (None, None)
    assert parse_request_args({"specplug_max_k": 0}, 4).max_k == 0
    assert parse_request_args({"specplug_max_k": 2.0}, 4).max_k == 2
    assert parse_request_args({"specplug_max_k": 100}, 4).max_k == 4  # clamped to the server's
    for bad in (-1, 2.5, "3", True, None, float("nan"), MAX_REQUEST_K + 1, [1]):
        with pytest.raises(SpecPlugRequestError, match="specplug_max_k"):
            parse_request_args({"specplug_max_k": bad}, 4)
    with pytest.raises(SpecPlugRequestError, match="unknown per-request key"):
        parse_request_args({"specplug_maxk": 1}, 4)


def test_request_fixed_k_parsing():
    assert parse_request_args({"specplug_k": 0}, 4) == (None, 0)
    assert parse_request_args({"specplug_k": 3}, 4) == (None, 3)
    assert parse_request_args({"specplug_k": 9}, 4) == (None, 4)  # the server's ceiling
    assert parse_request_args({"specplug_k": 3, "specplug_max_k": 2}, 4) == (2, 2)
    for bad in (-1, 2.5, "3", True, None, float("nan"), MAX_REQUEST_K + 1, [1]):
        with pytest.raises(SpecPlugRequestError, match="specplug_k "):
            parse_request_args({"specplug_k": bad}, 4)
