"""Bad input never crashes: a clear error naming the problem, or a valid value.

Property-based (hypothesis) over the plugin config and the per-request
knobs: whatever JSON a user sends, ``SpecPlugConfig.from_dict`` returns a
valid config or raises ``SpecPlugConfigError`` naming the key, and
``parse_request_args`` returns a ceiling in range or raises
``SpecPlugRequestError`` naming ``specplug_*``; nothing else escapes.  Plus
the start-up cases against real vLLM: a draft with another vocabulary, the
scheduler class without a speculative config, and a bad config key.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CEILING, greedy, make_llm, scheduler_of, shutdown
from vllm_specplug.config import (MAX_REQUEST_K, SpecPlugConfig, SpecPlugConfigError,
                                  SpecPlugRequestError, parse_request_args)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)
KEYS = st.sampled_from([f.name for f in SpecPlugConfig.__dataclass_fields__.values()]
                       + ["polcy", "max-k", ""])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=4), st.integers(0, 16))
def test_config_fuzz_valid_or_named_error(raw, n):
    try:
        cfg = SpecPlugConfig.from_dict(raw, n)
    except SpecPlugConfigError as exc:
        msg = str(exc)
        assert 'additional_config["specplug"]' in msg
        assert any(k in msg for k in raw) or "unknown key" in msg
        return
    # Accepted: then every value is in range and the controller builds.
    settings_ = cfg.controller_settings(n)
    assert 0 <= settings_.max_k <= n
    assert cfg.policy in ("goodput", "static", "heuristic")


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.none(), st.dictionaries(st.sampled_from(
    ["specplug_max_k", "specplug_k", "specplug_x", "other", "specplug_"]), JSON, max_size=3)),
    st.integers(0, 16))
def test_request_args_fuzz_valid_or_named_error(extra, ceiling):
    try:
        args = parse_request_args(extra, ceiling)
    except SpecPlugRequestError as exc:
        assert "specplug_" in str(exc)
        return
    for v in args:
        assert v is None or (isinstance(v, int) and 0 <= v <= ceiling)
    if args.k is not None and args.max_k is not None:
        assert args.k <= args.max_k


@pytest.mark.parametrize("key", ["specplug_max_k", "specplug_k"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, MAX_REQUEST_K + 1, "3", [1],
                                 {"k": 1}, True, 1.5])
def test_request_values_reject_each_bad_kind(key, bad):
    with pytest.raises(SpecPlugRequestError, match=key):
        parse_request_args({key: bad}, CEILING)
    assert getattr(parse_request_args({key: 2.0}, CEILING), key[len("specplug_"):]) == 2
    assert math.isfinite(getattr(parse_request_args({key: MAX_REQUEST_K}, CEILING),
                                 key[len("specplug_"):]))


def test_bad_config_key_stops_startup_with_the_key(tiny_models):
    with pytest.raises(Exception, match="prior_strenght"):
        make_llm(tiny_models["target"], speculative={
            "method": "draft_model", "model": tiny_models["target"],
            "num_speculative_tokens": CEILING}, specplug={"prior_strenght": 1.0})


def test_draft_with_another_vocabulary_is_refused_at_startup(tiny_models):
    with pytest.raises(Exception, match="(?i)vocab"):
        llm = make_llm(tiny_models["target"], speculative={
            "method": "draft_model", "model": tiny_models["draft_mismatch"],
            "num_speculative_tokens": CEILING})
        shutdown(llm)


def test_scheduler_class_without_speculation_is_inert_and_says_so(tiny_models, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.specplug"):
        llm = make_llm(tiny_models["target"], scheduler_cls="vllm_specplug.AdaptiveSpecScheduler")
    try:
        assert any("inert" in r.getMessage() and "no speculative config" in r.getMessage()
                   for r in caplog.records)
        assert scheduler_of(llm).specplug.enabled is False
        out = llm.generate(["w1 w2 w3"], greedy(8), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8
    finally:
        shutdown(llm)
