"""Easy and hard requests in one batch: K is chosen per request.

Uses the successor models (``vllm_specplug.tools.testing.make_successor_models``):
their greedy text is known in advance, so "easy" requests (a short cycle
the model continues) draft well with n-gram lookup and with
``copy_draft_half``, and "hard" requests (a long cycle whose words appear
in the prompt in the wrong order) get drafts that are always rejected.
Greedy output must equal plain decoding token for token.
"""

import numpy as np
import pytest

from conftest import (CEILING, drafted_per_step, greedy, make_llm, plain_token_ids, shutdown,
                      token_ids)
from vllm_specplug.tools.testing import easy_prompt, hard_prompt, make_successor_models

LONG = 64
PROMPTS = [easy_prompt(i) if i % 2 == 0 else hard_prompt(i) for i in range(8)]
EASY = range(0, 8, 2)
HARD = range(1, 8, 2)


@pytest.fixture(scope="module")
def successor_models(tmp_path_factory):
    return make_successor_models(tmp_path_factory.mktemp("successor-models"))


@pytest.fixture(scope="module")
def plain(successor_models):
    return plain_token_ids(successor_models["copy_target"], PROMPTS, LONG)


def check_mixed(outs, plain, label):
    assert token_ids(outs) == plain
    steps = [drafted_per_step(o) for o in outs]
    per_token = [sum(s) / LONG for s in steps]
    print(f"{label}: drafts per output token, easy:",
          [round(per_token[i], 2) for i in EASY], "hard:", [round(per_token[i], 2) for i in HARD])
    print(f"{label}: drafted per verify step, easy:", steps[0], "hard:", steps[1])
    for i in EASY:
        late = steps[i][len(steps[i]) // 2:]
        assert np.mean(late) >= CEILING - 1, (i, steps[i])
    for i in HARD:
        # Drafts that are never accepted: the request spends most steps
        # without any (fallback), verified only when probed or while the
        # policy still trusts the prior.
        assert per_token[i] <= 1.5, (i, steps[i])
        accepted = sum(outs[i].outputs[0].spec_decode_metrics.per_step_accepted or [0])
        assert accepted <= 2, (i, accepted)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_mixed_batch_gets_k_per_request(successor_models, plain, method):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": CEILING,
                "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec = {"method": "draft_model", "model": successor_models["copy_draft_half"],
                "num_speculative_tokens": CEILING}
    llm = make_llm(successor_models["copy_target"], speculative=spec)
    try:
        outs = llm.generate(PROMPTS, greedy(LONG), use_tqdm=False)
        check_mixed(outs, plain, method)
    finally:
        shutdown(llm)
