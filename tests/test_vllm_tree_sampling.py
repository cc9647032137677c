# SPDX-License-Identifier: Apache-2.0
"""Sampled requests inside vLLM are verified by walking their trees
(``vllm_esp.sampling``): the output has plain vLLM's distribution where
drafts are accepted often and at several depths, seeds repeat, logprobs are
the target's, and the walk accepts more than the chain reduction.

A tiny random Llama; the drafts come from a test-only source whose trees
hold the target's most likely tokens (read from plain vLLM's logprobs), so
that most draws land on a draft (``test_vllm_sampling.py`` checks the
chain-verified path, where accepts are rare).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from vllm_esp_dev.runs import generate, make_llm, run_once, shutdown
from vllm_esp_dev.stats import chi_square_homogeneity_p

pytestmark = pytest.mark.vllm

PROMPT = [11, 42, 7, 300, 5, 91, 250, 3]
# Low enough that the 4 most likely tokens hold most of the tiny model's
# mass (about 85% at the first position), so that most draws accept a draft.
TEMPERATURE = 0.3
NUM_SAMPLES = 3000
COMMON = dict(skip_tokenizer_init=True, max_model_len=256, max_num_seqs=128)
# 13 nodes: the table's 4 + 4 x 2 tokens fit.
TREE_CONFIG = {"method": "esp", "tree": [12], "candidates": ["esp"]}


def likely_tokens_table(model: str) -> list[list[list[int]]]:
    """The drafts' table (``LikelyTokensSource``): the target's 4 most likely
    tokens after ``PROMPT`` + each of its 4 most likely first tokens, and its
    2 most likely after each of those pairs, from plain vLLM's logprobs.
    (The first token comes from the prefill; the first tree follows it.)"""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model, **COMMON)

    def top(prompts, k):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=1, logprobs=k),
                               use_tqdm=False)
        return [[token for token, _ in sorted(o.outputs[0].logprobs[0].items(),
                                              key=lambda item: -item[1].logprob)][:k]
                for o in outputs]

    try:
        firsts = top([PROMPT], 4)[0]
        seconds = top([PROMPT + [t] for t in firsts], 4)
        pairs = [[t, u] for t, after in zip(firsts, seconds) for u in after]
        thirds = top([PROMPT + pair for pair in pairs], 2)
    finally:
        shutdown(llm)
    return ([[PROMPT + [t], after] for t, after in zip(firsts, seconds)]
            + [[PROMPT + pair, after] for pair, after in zip(pairs, thirds)])


def likely_source(table):
    return {"esp_candidate_source": {"class": "vllm_esp_dev.oracle.LikelyTokensSource",
                                     "kwargs": {"table": table}}}


@pytest.fixture(scope="module")
def table(tiny_llama_dir):
    return likely_tokens_table(tiny_llama_dir)


@pytest.fixture(scope="module")
def sampled(tiny_llama_dir, table):
    """Plain vLLM and ESP (walk, then chain) on the same seeded requests."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=4,
                             ignore_eos=True) for seed in range(NUM_SAMPLES)]
    prompts = [PROMPT] * NUM_SAMPLES
    plain = run_once(tiny_llama_dir, prompts, params, **COMMON)
    runs = {"plain": plain}
    for name in ("tree", "chain"):
        llm = make_llm(tiny_llama_dir, {**TREE_CONFIG, "sampling_verification": name},
                       additional_config=likely_source(table), **COMMON)
        try:
            counts_before = llm.collective_rpc("esp_row_counts")[0]
            runs[name] = generate(llm, prompts, params)
            counts_after = llm.collective_rpc("esp_row_counts")[0]
        finally:
            shutdown(llm)
        runs[name].walk_steps = counts_after["walk_steps"] - counts_before["walk_steps"]
    return runs


def test_the_walk_accepts_often_and_more_than_the_chain(sampled):
    tree, chain = sampled["tree"], sampled["chain"]
    assert tree.walk_steps > 0 and chain.walk_steps == 0
    # After the prefill's token most requests verify the table's tree of
    # depth 2; most draws are among its 4 likely tokens, and then often the
    # next among 2.
    print(f"accepted: walk {tree.num_accepted}, chain {chain.num_accepted}")
    assert tree.num_accepted > 0.8 * NUM_SAMPLES
    assert tree.num_accepted > 1.2 * chain.num_accepted


# Token 1 comes from the prefill; tokens 2-4 from the walk of the first tree.
@pytest.mark.parametrize("position", ["token 2", "token 3", "token 4", "tokens 2-3"])
def test_walk_sampling_has_plain_vllms_distribution(sampled, position):
    select = {"token 2": lambda t: t[1], "token 3": lambda t: t[2],
              "token 4": lambda t: t[3], "tokens 2-3": lambda t: (t[1], t[2])}[position]
    plain = Counter(map(select, sampled["plain"].token_ids))
    walked = Counter(map(select, sampled["tree"].token_ids))
    p_value = chi_square_homogeneity_p(plain, walked)
    assert p_value > 1e-3, f"{position}: the walk's distribution differs (p={p_value:.2e})"


def test_these_samples_would_show_a_three_percent_shift(sampled):
    # The check's power at this sample size: move 3% of plain's mass from
    # its most common second token to another, resample, and it is caught.
    plain = Counter(t[1] for t in sampled["plain"].token_ids)
    tokens = sorted(plain)
    probs = np.array([plain[t] for t in tokens], np.float64) / NUM_SAMPLES
    most, least = int(np.argmax(probs)), int(np.argmin(probs))
    probs[most] -= 0.03
    probs[least] += 0.03
    shifted = np.random.default_rng(0).choice(tokens, size=NUM_SAMPLES, p=probs)
    assert chi_square_homogeneity_p(plain, Counter(shifted.tolist())) < 1e-3


def test_walk_seeds_repeat_and_logprobs_are_the_targets(tiny_llama_dir, table):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=12,
                             ignore_eos=True, logprobs=2, presence_penalty=0.5)
              for seed in range(16)]
    llm = make_llm(tiny_llama_dir, TREE_CONFIG, additional_config=likely_source(table),
                   **COMMON)
    try:
        prompts = [TokensPrompt(prompt_token_ids=PROMPT)] * len(params)
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        walked = llm.collective_rpc("esp_row_counts")[0]["walk_steps"]
    finally:
        shutdown(llm)
    assert walked > 0
    tokens = [list(o.outputs[0].token_ids) for o in first]
    assert tokens == [list(o.outputs[0].token_ids) for o in second]
    assert len({tuple(t) for t in tokens}) > 8
    # Each reported logprob is the target's raw logprob of the token drawn
    # at that position: plain vLLM's prompt logprobs of the same text.
    check = make_llm(tiny_llama_dir, **COMMON)
    try:
        scored = check.generate(
            [TokensPrompt(prompt_token_ids=PROMPT + t) for t in tokens],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        shutdown(check)
    for output, reference, sampled_tokens in zip(first, scored, tokens):
        reported = output.outputs[0].logprobs
        assert len(reported) == len(sampled_tokens)
        for position, token in enumerate(sampled_tokens):
            expected = reference.prompt_logprobs[len(PROMPT) + position][token].logprob
            assert reported[position][token].logprob == pytest.approx(expected, abs=1e-4)


def test_steps_without_drafts_sample_exactly_as_plain_vllm(tiny_llama_dir):
    """Steps in which no request has drafts are sampled by vLLM's Sampler
    (not its RejectionSampler): seeded sampled requests with top-p,
    penalties and logprobs, beside greedy ones, get plain vLLM's tokens and
    logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 1
                                              for j in range(6 + i)]) for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, top_p=0.9,
                             seed=None if i % 3 == 0 else 100 + i, max_tokens=10,
                             ignore_eos=True, logprobs=2, frequency_penalty=0.3)
              for i in range(len(prompts))]
    outputs = {}
    for name, config, extra in (
            ("plain", None, {}),
            ("esp", {"method": "esp"}, {"additional_config": {"esp_candidate_source": {
                "class": "vllm_esp_dev.oracle.NoTreeSource", "kwargs": {}}}})):
        llm = make_llm(tiny_llama_dir, config, **extra, **COMMON)
        try:
            outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
            if name == "esp":
                counts = llm.collective_rpc("esp_row_counts")[0]
        finally:
            shutdown(llm)
    assert counts["steps_without_drafts"] >= 9
    esp_tokens = [list(o.token_ids) for o in outputs["esp"]]
    assert esp_tokens == [list(o.token_ids) for o in outputs["plain"]]
    assert len({tuple(t) for t in esp_tokens}) == len(prompts)
    for esp_output, plain_output in zip(outputs["esp"], outputs["plain"]):
        assert len(esp_output.logprobs) == len(plain_output.logprobs) == 10
        for esp_position, plain_position in zip(esp_output.logprobs, plain_output.logprobs):
            assert esp_position.keys() == plain_position.keys()
            for token, logprob in plain_position.items():
                assert esp_position[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)
