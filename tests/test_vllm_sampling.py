# SPDX-License-Identifier: Apache-2.0
"""Sampling with ESP has the target's distribution (not just its support).

A tiny random Llama, one prompt, thousands of seeded requests: the empirical
distribution of the tokens ESP generates after the prefill must match plain
vLLM sampling. The drafts come from the test-only oracle source (the greedy
continuation hidden among distractors), so that both the accept and the
reject paths of verification are exercised often.
"""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_esp_dev.runs import run_once
from vllm_esp_dev.stats import chi_square_homogeneity_p

pytestmark = pytest.mark.vllm

NUM_SAMPLES = 2000
PROMPT = [11, 42, 7, 300, 5, 91, 250, 3]


def test_chi_square_helper_detects_a_shift():
    same = chi_square_homogeneity_p(Counter({1: 500, 2: 500}), Counter({1: 490, 2: 510}))
    shifted = chi_square_homogeneity_p(Counter({1: 500, 2: 500}), Counter({1: 400, 2: 600}))
    assert same > 0.1 and shifted < 1e-3


def test_esp_sampling_matches_plain_sampling_distribution(tiny_llama_dir):
    from vllm import SamplingParams

    common = dict(skip_tokenizer_init=True, max_model_len=256, max_num_seqs=128)
    greedy = run_once(tiny_llama_dir, [PROMPT],
                      SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                      **common).token_ids[0]
    params = [SamplingParams(temperature=0.5, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(NUM_SAMPLES)]
    plain = run_once(tiny_llama_dir, [PROMPT] * NUM_SAMPLES, params, **common)
    oracle = {"class": "vllm_esp_dev.oracle.OracleSource",
              "kwargs": {"continuations": [[PROMPT, greedy]], "vocab_size": 512}}
    esp = run_once(tiny_llama_dir, [PROMPT] * NUM_SAMPLES, params,
                   speculative_config={"method": "esp", "tree": [3, 2]},
                   additional_config={"esp_candidate_source": oracle}, **common)

    # Both verification outcomes must occur for the test to mean much: drafts
    # are accepted only while a sample follows the greedy path, so accepts
    # are the rarer event (about 2-3% of drafts at this temperature).
    assert esp.num_drafts > NUM_SAMPLES
    assert 40 <= esp.num_accepted < esp.num_drafts

    for name, select in [("token 2", lambda t: t[1]), ("token 3", lambda t: t[2]),
                         ("tokens 2-3", lambda t: (t[1], t[2]))]:
        p_value = chi_square_homogeneity_p(Counter(map(select, plain.token_ids)),
                                           Counter(map(select, esp.token_ids)))
        assert p_value > 1e-3, f"{name}: ESP sampling distribution differs (p={p_value:.2e})"
