# SPDX-License-Identifier: Apache-2.0
"""Candidate sources: prompt lookup and the ESP mask source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.proposal import placeholder_tree, static_next_tree
from vllm_esp.core.tree import chain_tree
from vllm_esp_dev.sources import (
    CandidateSource,
    ESPMaskSource,
    PromptLookupSource,
    ProposalContext,
    find_ngram_continuation,
)

A, B, C, D, E, F = range(1, 7)


def _propose(source, history):
    return source.propose(ProposalContext(history, history[-1]))


def test_docstring_example_prefers_longest_then_most_recent():
    history = [A, B, C, D, B, C, E, F, B, C]
    tree = _propose(PromptLookupSource(max_ngram=3, num_draft_tokens=3), history)
    assert tree.tree_spec == chain_tree(3)
    assert tree.tokens.tolist() == [C, E, F, B]   # after the occurrence at index 4


def test_longer_ngram_wins_over_more_recent_shorter_one():
    history = [A, B, C, D, E, C, F, A, B, C]
    # "A B C" occurs at 0 (-> D E); "C" alone occurs later at 5 (-> F).
    tree = _propose(PromptLookupSource(max_ngram=3, num_draft_tokens=2), history)
    assert tree.draft_tokens.tolist() == [D, E]
    tree = _propose(PromptLookupSource(max_ngram=1, num_draft_tokens=2), history)
    assert tree.draft_tokens.tolist() == [F, A]


def test_continuation_truncated_at_history_end_and_min_ngram():
    history = [A, B, A, B]
    tree = _propose(PromptLookupSource(num_draft_tokens=5), history)
    # Suffix "B A B" does not recur; "A B" occurs at 0 -> continuation "A B".
    assert tree.draft_tokens.tolist() == [A, B]
    assert _propose(PromptLookupSource(min_ngram=3), history) is None


def test_no_match_and_short_history():
    assert _propose(PromptLookupSource(), [A, B, C, D]) is None
    assert _propose(PromptLookupSource(), [A]) is None


def test_tensor_history_and_masks():
    source = PromptLookupSource(max_ngram=2, num_draft_tokens=4, num_mask_tokens=1)
    tree = source.propose(ProposalContext(torch.tensor([A, B, C, A, B]), B))
    assert tree.tokens.tolist() == [B, C, A, B]
    assert tree.tree_spec == chain_tree(3, 1) and tree.layout.block_size == 8


def test_context_must_end_with_root():
    with pytest.raises(ValueError):
        PromptLookupSource().propose(ProposalContext([A, B], C))


def test_find_ngram_continuation_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=rng.integers(1, 30))
        got = find_ngram_continuation(tokens, 3, 1, 4).tolist()
        expected = []
        for n in range(min(3, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:].tolist()
            starts = [i for i in range(len(tokens) - n)
                      if tokens[i:i + n].tolist() == suffix]
            if starts:
                expected = tokens[starts[-1] + n:starts[-1] + n + 4].tolist()
                break
        assert got == expected


def test_esp_mask_source():
    config = ESPConfig(tree=(4,))
    source = ESPMaskSource(config)
    assert isinstance(source, CandidateSource)
    first = source.propose(ProposalContext([A, B], B))
    assert torch.equal(first.tokens, placeholder_tree(config, B).tokens)
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
    tree = source.propose(ProposalContext([A, B], B, logits))
    assert torch.equal(tree.tokens, static_next_tree(logits, (4,), B).tokens)
