"""``patches.install_once``: a patch installs once, or says once why not (no engine)."""

import logging


def test_a_patch_for_code_this_vllm_lacks_is_not_needed_and_warns_nothing(caplog):
    from vllm_specplug import patches

    def owner():
        import vllm.v1.spec_decode.specplug_no_such_module  # noqa: F401

    with caplog.at_level(logging.INFO, logger="vllm.specplug"):
        why = patches.install_once("test-absent-owner", owner, {"propose": lambda f: f},
                                   "a consequence")
        again = patches.install_once("test-absent-owner", owner, {"propose": lambda f: f},
                                     "a consequence")
    assert why == again and "is not in this vLLM" in why
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_a_changed_target_leaves_vllm_untouched_with_one_warning(caplog):
    from vllm_specplug import patches

    class Target:
        def other(self):
            return 1

    with caplog.at_level(logging.INFO, logger="vllm.specplug"):
        why = patches.install_once("test-changed-owner", lambda: Target,
                                   {"propose": lambda f: f}, "vLLM's behaviour")
    assert "has no propose" in why and not hasattr(Target, "propose")
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_the_v1_runner_patches_on_the_installed_vllm():
    """Where vLLM still has V1's proposers (0.32, 0.33) the zero-cost and
    confidence patches install; vLLM 0.34 has none: they are not needed, and
    say so at INFO, as the kernel-override scan's patch, whose fix 0.34 carries."""
    import importlib.util

    from vllm.triton_utils import dispatcher

    from vllm_specplug.patches import install_all

    results = install_all()
    v1 = importlib.util.find_spec("vllm.v1.spec_decode.draft_model") is not None
    for name in ("draft_model_skip", "draft_confidence", "ngram_threads"):
        if v1:
            assert results[name] is None, results
        else:
            assert "is not in this vLLM" in results[name], results
    # The start-up profile's hook and the per-request check install on all.
    assert results["startup_profile"] is None and results["request_args_check"] is None
    if hasattr(dispatcher, "_rebind_kernels"):
        assert results["kernel_override_scan"] is None
    else:
        assert "_rebind_impls" in results["kernel_override_scan"]
