# SPDX-License-Identifier: Apache-2.0
"""Hybrid trees: ESP mask candidates + prompt-lookup candidates in one block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_esp.config import ESPConfig, ESPConfigError
from vllm_esp.core.batch import TreeProposer
from vllm_esp.core.goodput import SOURCE_CORPUS, SOURCE_LOOKUP
from vllm_esp.core.hybrid import (
    LOOKUP_ACCEPT,
    LOOKUP_MAX_CHAINS,
    LOOKUP_MAX_CONTEXT,
    AnswerCorpus,
    allocate_block,
    find_ngram_matches,
    hybrid_next_tree,
    lookup_candidates,
    lookup_chains,
    lookup_occurrences,
    merge_candidates,
)
from vllm_esp.core.proposal import dynamic_next_tree, esp_candidates, select_tree
from vllm_esp.core.sources import (
    ESPMaskSource,
    HybridSource,
    PromptLookupSource,
    ProposalContext,
    candidate_source,
)
from vllm_esp.core.tree import chain_tree

X, THE, CAT, SAT, DOT, IS, WAS = range(7)
VOCAB = 10
DOC_ACCEPT = (0.0, 0.25, 0.45, 0.6, 0.7, 0.75)


def _mask_logits(probs: dict[int, float], vocab: int = VOCAB) -> torch.Tensor:
    rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
    p = torch.full((vocab,), rest)
    for token, value in probs.items():
        p[token] = value
    return p.log()[None]


def _paths(tree) -> set[tuple[int, ...]]:
    """Every node as its root-to-node token path (order-independent view)."""
    parents, tokens = tree.tree_spec.parents, tree.tokens.tolist()
    paths = set()
    for node in range(1, len(parents)):
        path, current = [], node
        while current > 0:
            path.append(tokens[current])
            current = parents[current]
        paths.add(tuple(reversed(path)))
    return paths


def test_docstring_worked_example():
    history = np.array([X, THE, CAT, SAT, DOT, THE, CAT])
    mask = _mask_logits({IS: 0.5, SAT: 0.3, WAS: 0.1})
    tree = hybrid_next_tree(history, CAT, mask, block_size=8, num_mask_tokens=1,
                            candidates=("esp", "ngram"), esp_weight=0.5,
                            lookup_accept=DOC_ACCEPT, mask_value=0.3)
    assert tree.root_token == CAT
    assert tree.tree_spec.num_mask_tokens == 1
    assert _paths(tree) == {(SAT,), (SAT, DOT), (SAT, DOT, THE), (SAT, DOT, THE, CAT),
                            (IS,)}
    # BFS order, most probable first within a level.
    assert tree.tokens.tolist() == [CAT, SAT, IS, DOT, THE, CAT]
    assert tree.tree_spec.parents == (-1, 0, 0, 1, 3, 4)
    assert tree.tree_spec.masked == (True, False, True, False, False, False)
    assert tree.layout.block_size == 8


def test_allocate_block_docstring_example():
    chain = lookup_candidates(np.array([7, 1, 2, 3, 9, 7]), node_budget=3,
                              lookup_accept=(0.0, 0.8, 0.75, 0.5))
    # r = .8, .8 * .75 = .6, .6 * .5 = .3
    assert np.allclose(chain.scores.exp().tolist(), [1, 0.8, 0.6, 0.3], atol=1e-6)
    kept, masked = allocate_block(chain, block_size=4, num_mask_tokens=1, mask_value=0.3)
    assert kept.tolist() == [0, 1, 2, 3] and not masked.any()
    lone = lookup_candidates(np.array([7, 1, 7]), node_budget=1,
                             lookup_accept=(0.0, 0.2))
    kept, masked = allocate_block(lone, block_size=3, num_mask_tokens=1, mask_value=0.3)
    assert kept.tolist() == [0, 1] and masked.tolist() == [True, False]


def test_find_ngram_matches_longest_then_all_occurrences():
    history = np.array([1, 2, 3, 9, 2, 3, 8, 5, 2, 3])
    n, starts = find_ngram_matches(history, 3, 1)
    assert n == 2 and starts.tolist() == [3, 6]
    assert find_ngram_matches(np.array([1, 2, 3]), 3, 1)[1].size == 0


def test_lookup_scores_fall_along_the_chain_and_use_match_count():
    # "2 3" occurred twice: followed by 9 once and by 8 (most recent) once.
    history = np.array([1, 2, 3, 9, 2, 3, 8, 5, 2, 3])
    chain = lookup_candidates(history, node_budget=3, lookup_accept=DOC_ACCEPT)
    assert chain.tokens.tolist() == [3, 8, 5, 2]
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    expected = np.cumsum(np.log([0.45, 0.6, 0.7])) + np.log(0.5)
    np.testing.assert_allclose(chain.scores[1:].numpy(), expected, rtol=1e-6)
    # With agreeing occurrences the same chain scores higher.
    agreeing = np.array([1, 2, 3, 8, 5, 2, 3, 8, 5, 2, 3])
    higher = lookup_candidates(agreeing, node_budget=1, lookup_accept=DOC_ACCEPT)
    assert higher.scores[1] > chain.scores[1]
    assert bool((chain.scores[1:] <= chain.scores[:-1]).all())


def test_older_occurrences_with_other_continuations_become_branches():
    # "5" occurred 3 times: followed by 6 7 (oldest), 8 9, and 6 1 (newest).
    history = np.array([5, 6, 7, 5, 8, 9, 5, 6, 1, 5])
    chains = lookup_chains(history, node_budget=2, max_chains=3, lookup_accept=DOC_ACCEPT)
    # One chain per distinct first token, newest first; 6 7 shares 6 with 6 1.
    assert [c.tokens[1:].tolist() for c in chains] == [[6, 1], [8, 9]]
    # 6 is followed by 6 in 2 of 3 occurrences, 8 in 1 of 3.
    np.testing.assert_allclose(np.exp(chains[0].scores[1].item()), 0.25 * 2 / 3, rtol=1e-5)
    np.testing.assert_allclose(np.exp(chains[1].scores[1].item()), 0.25 * 1 / 3, rtol=1e-5)
    # No mask logits (the last accepted node had no masks): the chains alone,
    # plus the root's masks.
    tree = hybrid_next_tree(history, 5, None, block_size=7,
                            num_mask_tokens=1, candidates=("esp", "ngram"),
                            lookup_accept=DOC_ACCEPT, mask_value=0.3)
    assert {(6,), (6, 1), (8,), (8, 9)} == _paths(tree)
    assert tree.tree_spec.masked[0] and tree.layout.block_size == 7
    # Lookup alone stays pure prompt lookup: the newest chain only.
    alone = hybrid_next_tree(history, 5, None, 4, 1, ("ngram",), lookup_accept=DOC_ACCEPT)
    assert _paths(alone) == {(6,), (6, 1), (6, 1, 5)}


@pytest.mark.parametrize("seed", range(10))
def test_merge_shares_prefix_and_keeps_larger_score(seed):
    mask = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed))
    tree = esp_candidates(mask, 4, root_token=0)
    first = int(tree.tokens[1])  # most probable level-1 candidate
    # A second chain token that is not an ESP child of `first`.
    children = set(tree.tokens[tree.parents == 1].tolist())
    second = next(t for t in range(1, VOCAB) if t not in children and t != first)
    chain = lookup_candidates(np.array([0, first, second, 0]), node_budget=3)
    merged = merge_candidates(tree, chain)
    shared = int(torch.nonzero((merged.parents == 0) & (merged.tokens == first))[0, 0])
    assert shared == 1
    assert merged.scores[1] == max(tree.scores[1], chain.scores[1])
    # The rest of the chain hangs below the shared node, once.
    assert merged.num_candidates == tree.num_candidates + 2
    new = merged.num_candidates - 2
    assert merged.parents[new:].tolist() == [1, new]
    assert merged.depths[new:].tolist() == [2, 3]


@pytest.mark.parametrize("seed", range(40))
def test_hybrid_tree_respects_budget_and_is_a_tree(seed):
    generator = np.random.default_rng(seed)
    vocab = int(generator.integers(4, 40))
    k = int(generator.integers(1, 4))
    block_size = int(generator.integers(k + 2, 40))
    history = generator.integers(0, vocab, size=int(generator.integers(2, 60)))
    mask = torch.from_numpy(generator.normal(size=(k, vocab))).float() * 3
    mask_value = float(generator.choice([0.0, 0.1, 0.3, 0.9]))
    tree = hybrid_next_tree(history, int(history[-1]), mask, block_size, k,
                            ("esp", "ngram"), mask_value=mask_value)
    assert tree.num_nodes >= 2
    assert tree.tree_spec.num_mask_tokens == k
    # The rows are spent: at most block_size, and fewer only when k more
    # mask rows do not fit or nothing is left (every candidate kept, every
    # node masked).
    assert tree.layout.block_size <= block_size
    assert (block_size - tree.layout.block_size < k) or all(tree.tree_spec.masked)
    # No two siblings share a token (duplicates are merged).
    parents, tokens = tree.tree_spec.parents, tree.tokens.tolist()
    siblings = {(parents[i], tokens[i]) for i in range(1, len(parents))}
    assert len(siblings) == len(parents) - 1
    # Every node comes from a source: an ESP candidate path or a prefix of
    # a lookup chain.
    esp_paths = _paths(dynamic_next_tree(mask, block_size - 1, int(history[-1])))
    chain_paths = {tuple(chain.tokens[1:d + 1].tolist())
                   for chain in lookup_chains(history, block_size - 1, LOOKUP_MAX_CHAINS)
                   for d in range(1, chain.num_candidates)}
    assert _paths(tree) <= esp_paths | chain_paths


def _longest_context_continuation(history, budget, max_context=LOOKUP_MAX_CONTEXT):
    """Brute force: among the longest suffix n-gram's (n <= 3) earlier
    occurrences, the continuation of the one whose match extends furthest
    back (at most max_context tokens), the most recent among equals."""
    history = history.tolist()
    size = len(history)
    for n in range(min(3, size - 1), 0, -1):
        ends = [i + n for i in range(size - n) if history[i:i + n] == history[-n:]]
        if ends:
            break
    else:
        return []

    def context(end):
        length = n
        while (length < max_context and end - length - 1 >= 0
               and history[end - length - 1] == history[size - length - 1]):
            length += 1
        return length

    best = max(ends, key=lambda end: (context(end), end))
    return history[best:best + budget]


@pytest.mark.parametrize("seed", range(40))
def test_ngram_only_is_the_longest_context_chain(seed):
    generator = np.random.default_rng(seed)
    history = generator.integers(0, 4, size=int(generator.integers(2, 80)))
    budget = int(generator.integers(1, 12))
    config = ESPConfig.from_dict({"block_complexity": 2 * (budget + 1),
                                  "candidates": ["ngram"]})
    assert config.node_budget == budget
    context = ProposalContext(history, int(history[-1]))
    hybrid = candidate_source(config).propose(context)
    expected = _longest_context_continuation(history, budget)
    if not expected:
        assert hybrid is None
    else:
        assert hybrid.tree_spec == chain_tree(len(expected), 0)  # a chain, no masks
        assert hybrid.tokens.tolist() == [int(history[-1])] + expected


def test_lookup_prefers_the_occurrence_sharing_the_longest_context():
    # "1 2 3" occurred twice: at index 2, after "9 8" like the history's
    # end ("9 8 1 2 3": 5 tokens of shared context), and more recently at
    # index 8, after "7" (3 tokens).
    history = np.array([9, 8, 1, 2, 3, 4, 5, 7, 1, 2, 3, 6, 0, 9, 8, 1, 2, 3])
    starts, contexts = lookup_occurrences(history)
    assert starts.tolist() == [5, 11] and contexts.tolist() == [5, 3]
    first, second = lookup_chains(history, node_budget=2, max_chains=2)
    assert first.tokens[1:].tolist() == [4, 5] and second.tokens[1:].tolist() == [6, 0]
    # Scores use each occurrence's own context; the first chain's only peer
    # (context >= 5) is itself, the second's are both occurrences.
    np.testing.assert_allclose(
        first.scores[1:].exp().numpy(), np.cumprod(LOOKUP_ACCEPT[5:7]), rtol=1e-5)
    np.testing.assert_allclose(second.scores[1].exp().item(), LOOKUP_ACCEPT[3] / 2, rtol=1e-5)
    # Pure prompt lookup (vLLM's ngram) keeps taking the most recent one.
    lookup = PromptLookupSource(3, 1, num_draft_tokens=2).propose(ProposalContext(history, 3))
    assert lookup.tokens.tolist() == [3, 6, 0]


def test_answer_corpus_keeps_the_latest_answers_within_its_size():
    corpus = AnswerCorpus(8)
    corpus.add([5, 6, 7])
    corpus.add([8, 9])
    assert corpus.tokens.tolist() == [5, 6, 7, -1, 8, 9, -1]
    corpus.add([1, 2, 3])
    assert corpus.tokens.tolist() == [8, 9, -1, 1, 2, 3, -1]
    corpus.add(list(range(20)))  # longer than the whole cache: its end
    assert corpus.tokens.tolist() == list(range(13, 20)) + [-1]
    off = AnswerCorpus(0)
    off.add([1, 2])
    assert off.tokens.size == 0


def test_lookup_searches_earlier_answers_and_stops_at_their_end():
    corpus = AnswerCorpus(64)
    corpus.add([1, 2, 3, 4, 5, 6, 7])
    corpus.add([9, 9])
    # "3 4 5" never occurred in the request's own history, but in an
    # earlier answer, where 6 7 and the answer's end followed.
    history = np.array([8, 3, 4, 5])
    assert lookup_chains(history, node_budget=4) == []
    (chain,) = lookup_chains(history, node_budget=4, corpus=corpus.tokens)
    assert chain.tokens[1:].tolist() == [6, 7]
    np.testing.assert_allclose(chain.scores[1:].exp().numpy(),
                               np.cumprod(LOOKUP_ACCEPT[3:5]), rtol=1e-5)
    # Equal contexts (3 tokens each): the request's own, more recent, wins.
    own = np.array([3, 4, 5, 0, 8, 3, 4, 5])
    (chain,) = lookup_chains(own, node_budget=2, corpus=corpus.tokens)
    assert chain.tokens[1:].tolist() == [0, 8]


def test_chains_from_earlier_answers_carry_their_own_source_tag():
    config = ESPConfig.from_dict({"block_complexity": 6, "candidates": ["ngram"]})
    proposer = TreeProposer(config)
    corpus = AnswerCorpus(64)
    corpus.add([1, 2, 3, 4, 5, 6, 7])
    histories = np.array([[8, 3, 4, 5], [4, 5, 9, 4]])
    cand = np.zeros((2, 1, proposer.candidate_width))

    def propose(corpus_tokens, corpus_rows=None):
        return proposer.propose(histories, np.arange(2), np.zeros(2, np.int64),
                                np.full(2, 4), histories[:, -1].copy(), cand.astype(np.int64),
                                cand.astype(np.float32), np.zeros(2, np.bool_), 16,
                                corpus=corpus_tokens, corpus_rows=corpus_rows)

    trees = propose(corpus.tokens)
    # Request 0's chain comes from the cache, request 1's ("4" -> 5 9) from
    # its own history.
    assert trees.tokens[0, :3].tolist() == [5, 6, 7]
    assert trees.sources[0, 1:3].tolist() == [SOURCE_CORPUS] * 2
    assert trees.tokens[1, :3].tolist() == [4, 5, 9]
    assert trees.sources[1, 1:3].tolist() == [SOURCE_LOOKUP] * 2
    assert propose(None).num_nodes.tolist() == [0, 3]
    # Requests left out of the cache (seeded ones) see only their own history.
    assert propose(corpus.tokens, np.array([False, True])).num_nodes.tolist() == [0, 3]


@pytest.mark.parametrize("seed", range(20))
def test_without_lookup_match_nodes_are_the_best_esp_candidates(seed):
    generator = torch.Generator().manual_seed(seed)
    k = seed % 3 + 1
    mask = torch.randn(k, 50, generator=generator) * 2
    history = np.arange(10, 30)  # no repeated token: no lookup match
    block_size = 24
    # Mask rows worth nothing: the block is the dynamic ESP tree of
    # block_size - 1 nodes (then masks only if k rows still fit: never, here),
    # whatever the ESP weight.
    esp = dynamic_next_tree(mask, block_size - 1, 29)
    for weight in (0.1, 0.35, 1.0):
        tree = hybrid_next_tree(history, 29, mask, block_size, k, ("esp", "ngram"),
                                esp_weight=weight, mask_value=0.0)
        assert tree.tree_spec.parents == esp.tree_spec.parents
        assert tree.tokens.tolist() == esp.tokens.tolist()
        assert not any(tree.tree_spec.masked)
    # Valued masks: the root, the likeliest last accepted node, gets them.
    config = ESPConfig.from_dict({"block_complexity": block_size, "num_mask_tokens": k,
                                  "candidates": ["esp", "ngram"]})
    tree = HybridSource(config).propose(ProposalContext(history, 29, mask))
    assert tree.tree_spec.masked[0]
    pool = esp_candidates(mask, block_size - 1, 29)
    assert _paths(tree) <= _paths(select_tree(pool, pool.num_candidates - 1, k))
    assert math.isclose(float(esp_candidates(mask, 6, 29).scores[0]), 0.0)


def test_first_step_uses_lookup_or_placeholder():
    config = ESPConfig.from_dict({"block_complexity": 10, "candidates": ["esp", "ngram"]})
    source = HybridSource(config)
    no_match = source.propose(ProposalContext([5, 6, 7], 7))
    assert no_match.draft_tokens.tolist() == [7, 7, 7, 7]  # ESP placeholder
    match = source.propose(ProposalContext([5, 6, 7, 5, 6], 6))
    assert match.draft_tokens.tolist() == [7, 5, 6]
    assert match.tree_spec.num_mask_tokens == 1


def test_budget_goes_to_the_more_likely_source():
    # Only a 1-gram match ("1" at index 0): a weak chain 4 5 6 7 2 3.
    history = np.array([1, 4, 5, 6, 7, 2, 3, 9, 1])
    flat = torch.zeros(1, 20)  # ESP knows nothing: uniform masks
    tree = hybrid_next_tree(history, 1, flat, block_size=8, num_mask_tokens=1,
                            candidates=("esp", "ngram"), mask_value=0.3)
    chain = (4, 5, 6, 7, 2, 3)
    # Every node is the chain's (none of ESP's uniform candidates), and it
    # gets most of the block.
    assert _paths(tree) <= {chain[:d] for d in range(1, 7)}
    assert chain[:5] in _paths(tree)
    # A confident mask beats the weak chain's deeper tokens, not its first.
    confident = _mask_logits({11: 0.97}, vocab=20)
    tree = hybrid_next_tree(history, 1, confident, block_size=8, num_mask_tokens=1,
                            candidates=("esp", "ngram"), mask_value=0.3)
    assert (11,) in _paths(tree) and (4,) in _paths(tree)
    assert (4, 5, 6, 7, 2, 3) not in _paths(tree)


def test_a_confident_chain_fills_the_block_and_a_weak_one_keeps_masks():
    # The 3-gram "1 2 3" repeats with the same continuation three times: a
    # long, confident chain.
    history = np.array([1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3])
    flat = torch.zeros(1, 20)
    tree = hybrid_next_tree(history, 3, flat, block_size=10, num_mask_tokens=1,
                            candidates=("esp", "ngram"))
    assert (4, 5, 6, 7, 8, 1, 2, 3) in _paths(tree)
    assert tree.num_nodes >= 9 and tree.layout.block_size == 10
    # Uniform masks would have left room for a chain of 4 only
    # (5 nodes + 5 mask rows).
    weak = np.array([1, 4, 5, 6, 7, 2, 3, 9, 1])  # a 1-gram match
    tree = hybrid_next_tree(weak, 1, flat, block_size=10, num_mask_tokens=1,
                            candidates=("esp", "ngram"))
    assert tree.tree_spec.masked[0]  # the root is the likeliest last node


def test_config_candidates():
    # Users get the hybrid by default; ESPConfig() is the paper's ESP.
    assert isinstance(candidate_source(ESPConfig.from_dict({})), HybridSource)
    assert isinstance(candidate_source(ESPConfig()), ESPMaskSource)
    assert isinstance(candidate_source(ESPConfig.from_dict({"candidates": ["esp"]})),
                      ESPMaskSource)
    config = ESPConfig.from_dict({"block_complexity": 30, "candidates": ["ngram", "esp"]})
    assert config.candidates == ("esp", "ngram") and config.is_hybrid
    assert config.block_size == 30 and config.masks_per_node == 1
    assert ESPConfig.from_serialized(config.to_dict()) == config
    lookup_only = ESPConfig.from_dict({"block_complexity": 30, "candidates": ["ngram"]})
    assert lookup_only.masks_per_node == 0 and lookup_only.block_size == 15
    for bad in (["esp", "esp"], [], "esp", ["eagle"], [["esp"]]):
        with pytest.raises(ESPConfigError, match="'candidates'.*esp.*ngram"):
            ESPConfig.from_dict({"candidates": bad})


