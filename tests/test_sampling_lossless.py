"""Losslessness under sampling: the token distribution does not change.

Speculative decoding with rejection sampling is exact in distribution, not
token for token.  With temperature 1 and an 8-word vocabulary (peaked
distributions), a thousand seeded requests per setting are sampled with plain decoding
and with the adaptive scheduler (a draft that is often wrong, so rejection
sampling runs), and the per-position token counts are compared with a
chi-square test of homogeneity at significance 0.001.  A second test shows
the check has power: a sampler biased by temperature 0.8 is rejected.

Finding (vLLM CPU 0.32): vLLM's own speculative decoding, with no plugin
(static K, ``draft_model`` or ``ngram``), fails this test against plain
decoding (chi-square in the thousands, p ~ 0; the first sampled token,
drawn at prefill, matches exactly, every later position differs).  The
plugin only chooses how many drafts are offered and cannot be exact in
distribution where vLLM's verification is not, so both comparisons are
marked as expected failures (strict: they turn into errors the day vLLM
is fixed, so the marks get removed).  Greedy decoding is exact (see
test_lossless.py).
"""

import math

import numpy as np
import pytest

from conftest import CEILING, make_llm, shutdown
from helpers import make_small_vocab_models

N_REQUESTS = 1000
MAX_TOKENS = 6
ALPHA = 0.001
PROMPT = "w1 w5 w2"


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for chi-square with ``dof`` degrees of freedom.

    The regularised upper incomplete gamma Q(dof/2, x/2): a series below
    a + 1, a continued fraction above (Numerical Recipes, gammq).
    """
    a, x = dof / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - gln))
    b = x + 1 - a
    c, d = 1e300, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - gln) * h


def homogeneity_p_value(a: np.ndarray, b: np.ndarray) -> tuple[float, float, int]:
    """Chi-square test that two count tables (positions x tokens) share a
    distribution, summed over positions.  Sparse cells are pooled."""
    stat, dof = 0.0, 0
    for row_a, row_b in zip(a, b):
        keep = (row_a + row_b) >= 10
        rest_a, rest_b = row_a[~keep].sum(), row_b[~keep].sum()
        ra = np.append(row_a[keep], rest_a) if rest_a + rest_b > 0 else row_a[keep]
        rb = np.append(row_b[keep], rest_b) if rest_a + rest_b > 0 else row_b[keep]
        table = np.stack([ra, rb]).astype(float)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        stat += float(((table - expected) ** 2 / expected).sum())
        dof += table.shape[1] - 1
    return chi2_sf(stat, dof), stat, dof


def test_chi2_sf_matches_known_values():
    # Table values: chi2(0.95, 1) = 3.841, chi2(0.999, 10) = 29.588.
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(29.588, 10) == pytest.approx(0.001, abs=1e-4)
    assert chi2_sf(100.0, 100) == pytest.approx(0.481, abs=2e-3)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    return make_small_vocab_models(tmp_path_factory.mktemp("small-vocab"))


def sample_counts(llm, temperature=1.0):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=i,
                             ignore_eos=True) for i in range(N_REQUESTS)]
    outs = llm.generate([PROMPT] * N_REQUESTS, params, use_tqdm=False)
    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 16
    counts = np.zeros((MAX_TOKENS, max(vocab, 16)), dtype=np.int64)
    for o in outs:
        for pos, tok in enumerate(o.outputs[0].token_ids):
            counts[pos, tok] += 1
    return counts


@pytest.fixture(scope="module")
def plain_counts(small_models):
    llm = make_llm(small_models["small_target"], max_num_seqs=64)
    counts = {"t1": sample_counts(llm), "t08": sample_counts(llm, temperature=0.8)}
    shutdown(llm)
    return counts


VLLM_CPU_SAMPLING = pytest.mark.xfail(
    strict=True, reason="vLLM CPU 0.32's speculative sampling does not preserve the target "
    "distribution even without the plugin (see the module docstring)")


@VLLM_CPU_SAMPLING
def test_vllm_static_k_sampling_matches_plain_distribution(small_models, plain_counts):
    spec = {"method": "draft_model", "model": small_models["small_draft"],
            "num_speculative_tokens": CEILING}
    llm = make_llm(small_models["small_target"], speculative=spec, adaptive=False,
                   max_num_seqs=64)
    try:
        counts = sample_counts(llm)
    finally:
        shutdown(llm)
    p, stat, dof = homogeneity_p_value(plain_counts["t1"], counts)
    print(f"vLLM static K vs plain: chi2 {stat:.1f} on {dof} dof, p = {p:.3g}")
    assert p > ALPHA


@VLLM_CPU_SAMPLING
def test_adaptive_sampling_matches_plain_distribution(small_models, plain_counts):
    spec = {"method": "draft_model", "model": small_models["small_draft"],
            "num_speculative_tokens": CEILING}
    llm = make_llm(small_models["small_target"], speculative=spec, max_num_seqs=64)
    try:
        counts = sample_counts(llm)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.specplug.controller.stats
    finally:
        shutdown(llm)
    p, stat, dof = homogeneity_p_value(plain_counts["t1"], counts)
    print(f"adaptive vs plain: chi2 {stat:.1f} on {dof} dof, p = {p:.3g}; "
          f"drafted {stats.drafted}, accepted {stats.accepted}")
    assert stats.drafted > 0 and stats.accepted > 0, "speculation did not run"
    assert p > ALPHA


def test_the_check_rejects_a_biased_sampler(plain_counts):
    p, stat, dof = homogeneity_p_value(plain_counts["t1"], plain_counts["t08"])
    print(f"temperature 0.8 vs 1.0: chi2 {stat:.1f} on {dof} dof, p = {p:.3g}")
    assert p < ALPHA
