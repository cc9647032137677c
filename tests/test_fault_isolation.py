# SPDX-License-Identifier: Apache-2.0
"""An error in ESP's per-step path must not take the engine down.

A tree proposer with an injected fault (``vllm_esp_dev.faults``) raises for
every batch that holds one poisoned request. ESP isolates the request the
error comes from: it decodes that request without blocks from then on, and
keeps speculating for the others. Every output stays equal to plain greedy
decoding and the engine keeps serving."""

from __future__ import annotations

import pytest

from vllm_esp_dev.faults import POISON
from vllm_esp_dev.runs import generate, make_llm, run_once, shutdown

pytestmark = pytest.mark.vllm


def test_failing_proposal_falls_back_to_plain_decoding_for_that_request(
        smollm2_dir, bundled_prompts):
    from vllm import SamplingParams

    prompts = [list(p) for p in bundled_prompts[:5]]
    poisoned = 2
    prompts[poisoned] = prompts[poisoned][:4] + list(POISON) + prompts[poisoned][4:]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = run_once(smollm2_dir, prompts, params, label="plain")

    # A fixed block, so every clean request drafts whatever this machine's
    # step costs are ('auto' may give a request no draft rows).
    llm = make_llm(smollm2_dir, {"method": "esp", "block_complexity": 10,
                                 "candidates": ["esp", "ngram"]}, max_num_seqs=8,
                   per_request_spec_decode_metrics="detailed",
                   additional_config={"esp_candidate_source": {
                       "class": "vllm_esp_dev.faults.FaultyTreeProposer"}})
    try:
        esp = generate(llm, prompts, params, label="esp")
        # The engine survived and still serves, with ESP for clean requests.
        again = generate(llm, prompts[:2], params, label="again")
    finally:
        shutdown(llm)
    assert esp.token_ids == plain.token_ids
    assert again.token_ids == plain.token_ids[:2]
    drafted = [(m or {}).get("num_draft_tokens", 0) for m in esp.spec_metrics]
    assert drafted[poisoned] == 0, drafted
    assert all(d > 0 for i, d in enumerate(drafted) if i != poisoned), drafted
    assert again.num_drafts > 0
