# SPDX-License-Identifier: Apache-2.0
"""Steps whose tokens are their rows' argmax are verified by ESP itself
(``core.greedy``, ``sampling.argmax_decides``), not by vLLM's samplers:
the same tokens as vLLM's RejectionSampler, and never when something
moves the argmax (penalties, min_tokens, logprobs, ...).

The engine test uses a tiny random Llama and drafts from the test-only
oracle (the plain output hidden among distractors), so that most drafts are
accepted and the path is exercised at depth."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_esp.core.batch import chain_rows
from vllm_esp.core.greedy import argmax_rows, greedy_chain_tokens
from vllm_esp.sampling import argmax_decides
from vllm_esp_dev.runs import generate, make_llm, shutdown

pytestmark = pytest.mark.vllm

COMMON = dict(skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8)


def _greedy_metadata(num_requests: int, vocab: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    zeros = torch.zeros(num_requests)
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=zeros, presence_penalties=zeros,
        repetition_penalties=torch.ones(num_requests),
        output_token_ids=[[] for _ in range(num_requests)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def test_argmax_verification_equals_vllms_rejection_sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_esp.runner import chain_spec_decode_metadata

    # The platform's kernels for the sampler, as an engine registers them.
    current_platform.register_triton_kernel_overrides()
    rng = np.random.default_rng(0)
    vocab = 64
    sampler = RejectionSampler(Sampler())
    for _ in range(40):
        num_requests = int(rng.integers(1, 7))
        num_drafts = rng.integers(0, 5, size=num_requests)
        rows = int((num_drafts + 1).sum())
        # Extra rows between requests, as a block's unverified nodes are.
        sizes = num_drafts + 1 + rng.integers(0, 3, num_requests)
        logit_starts = np.cumsum(sizes) - sizes
        logits = torch.from_numpy(rng.standard_normal(
            (int(sizes.sum()), vocab)).astype(np.float32))
        argmax = logits.argmax(dim=-1).numpy()
        # Drafts that are mostly the argmax, so that chains are accepted deep.
        drafts = np.concatenate([
            np.where(rng.random(n) < 0.75, argmax[start:start + n], rng.integers(0, vocab, n))
            for start, n in zip(logit_starts, num_drafts)] + [np.zeros(0, np.int64)])
        layout = chain_rows(np.zeros(0, np.int64), logit_starts, num_drafts, drafts,
                            np.zeros((0, 1), np.int64), np.zeros(0, np.int64),
                            np.zeros((0, 1), np.int64), True)
        assert layout.rows.shape[0] == rows
        expected = sampler(chain_spec_decode_metadata(layout, logits.device), None,
                           logits.clone(), _greedy_metadata(num_requests, vocab))
        ours = greedy_chain_tokens(argmax_rows(logits)[layout.rows],
                                   layout.draft_token_ids, layout.num_draft_tokens)
        np.testing.assert_array_equal(ours, expected.sampled_token_ids.numpy())


def test_argmax_decides_only_when_nothing_moves_the_argmax():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    base = _greedy_metadata(2, 16)
    assert argmax_decides(base)

    def replaced(**changes):
        return argmax_decides(dataclasses.replace(base, **changes))

    assert not replaced(all_greedy=False)
    assert not replaced(max_num_logprobs=0)
    assert not replaced(logprob_token_ids={0: [3]})
    assert not replaced(no_penalties=False)
    assert not replaced(bad_words_token_ids={0: [[5]]})
    assert not replaced(allowed_token_ids_mask=torch.zeros(2, 16, dtype=torch.bool))
    min_tokens = object.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {}
    assert replaced(logitsprocs=LogitsProcessors([min_tokens]))
    min_tokens.min_toks = {0: (4, [], {2}, False)}
    assert not replaced(logitsprocs=LogitsProcessors([min_tokens]))

    class Custom:
        def is_argmax_invariant(self):
            return False

    assert not replaced(logitsprocs=LogitsProcessors([Custom()]))


def test_argmax_steps_give_plain_tokens_and_step_aside_for_penalties_and_min_tokens(
        tiny_llama_dir):
    """Three greedy batches through one ESP engine, against plain vLLM with
    the same parameters: plain greedy (ESP's argmax verification runs), a
    repetition penalty and min_tokens with a stop token (it must not run:
    if it did, it would emit what the penalty or min_tokens forbids)."""
    from vllm import SamplingParams

    prompts = {case: [[(11 * i + 5 * j + offset) % 500 + 1 for j in range(8 + i)]
                      for i in range(4)]
               for offset, case in enumerate(("greedy", "penalty", "min_tokens"))}
    unconstrained = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain_llm = make_llm(tiny_llama_dir, **COMMON)
    try:
        free = {case: generate(plain_llm, ids, unconstrained).token_ids
                for case, ids in prompts.items()}
        # min_tokens holds back, to the end, the stop token each request
        # emits second.
        params = {"greedy": [unconstrained] * 4,
                  "penalty": [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                             repetition_penalty=1.8)] * 4,
                  "min_tokens": [SamplingParams(temperature=0.0, max_tokens=16,
                                                stop_token_ids=[tokens[1]], min_tokens=16)
                                 for tokens in free["min_tokens"]]}
        plain = {case: generate(plain_llm, prompts[case], params[case]).token_ids
                 for case in prompts}
    finally:
        shutdown(plain_llm)
    # The constraints change the output, so ignoring them would show.
    assert plain["penalty"] != free["penalty"]
    assert plain["min_tokens"] != free["min_tokens"]

    oracle = {"class": "vllm_esp_dev.oracle.OracleSource",
              "kwargs": {"continuations": [[p, o] for case in prompts
                                           for p, o in zip(prompts[case], plain[case])],
                         "vocab_size": 512}}
    llm = make_llm(tiny_llama_dir, {"method": "esp", "tree": [3, 2]},
                   additional_config={"esp_candidate_source": oracle}, **COMMON)
    try:
        runs, argmax_steps = {}, {}
        for case in prompts:
            before = llm.collective_rpc("esp_row_counts")[0]["argmax_steps"]
            runs[case] = generate(llm, prompts[case], params[case])
            argmax_steps[case] = llm.collective_rpc("esp_row_counts")[0]["argmax_steps"] - before
    finally:
        shutdown(llm)
    for case, run in runs.items():
        assert run.token_ids == plain[case], case
        assert run.num_accepted > 0, case
    assert argmax_steps["greedy"] >= 4
    assert argmax_steps["penalty"] == 0 and argmax_steps["min_tokens"] == 0
