# SPDX-License-Identifier: Apache-2.0
"""Hybrid trees: ESP mask candidates + prompt-lookup candidates in one block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_esp.config import ESPConfig, ESPConfigError
from vllm_esp.core.batch import TreeProposer, hybrid_next_tree
from vllm_esp.core.goodput import SOURCE_CORPUS, SOURCE_LOOKUP
from vllm_esp.core.hybrid import (
    LOOKUP_ACCEPT,
    LOOKUP_EXTEND,
    LOOKUP_MAX_CHAINS,
    LOOKUP_MAX_CONTEXT,
    LOOKUP_MAX_PEERS,
    LOOKUP_MIN_SHARE,
    AnswerCorpus,
    AnswerPools,
    allocate_block,
    find_ngram_matches,
    lookup_candidates,
    lookup_chains,
    lookup_occurrences,
    merge_candidates,
)
from vllm_esp.core.proposal import dynamic_next_tree, esp_candidates, select_tree
from vllm_esp.core.tree import chain_tree
from vllm_esp_dev.sources import (
    ESPMaskSource,
    HybridSource,
    PromptLookupSource,
    ProposalContext,
    candidate_source,
)

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
    # "1 2 7" occurred before, followed by 4 5 6: 3 tokens of context, so
    # the chain may be 3 tokens long.
    chain = lookup_candidates(np.array([9, 1, 2, 7, 4, 5, 6, 8, 1, 2, 7]), node_budget=3,
                              lookup_accept=(0.0, 0.0, 0.0, 0.8, 0.75, 0.5))
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


def test_lookup_path_follows_the_majority_and_scores_its_share():
    # "1 2" occurred three times: followed by 6 7, 6 8 and (most recently)
    # 9 9. Each occurrence shares 2 tokens of context, so the path is at
    # most 2 + LOOKUP_EXTEND tokens long (the node budget, 4, here).
    history = np.array([1, 2, 6, 7, 1, 2, 6, 8, 1, 2, 9, 9, 1, 2])
    chain = lookup_candidates(history, node_budget=4, lookup_accept=DOC_ACCEPT)
    # 6 is the majority (2 of 3). After 6 7 and 6 8 tie; the more recent
    # occurrence's 8 wins. f_1 = 2/3, f_2 = 1/3. Past the context, that
    # occurrence alone goes on: 1 2 (f 1/3), its scores falling with q.
    assert LOOKUP_EXTEND >= 2
    assert chain.tokens.tolist() == [2, 6, 8, 1, 2]
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    expected = np.log([0.45 * 2 / 3, 0.45 * 0.6 / 3, 0.45 * 0.6 * 0.7 / 3,
                       0.45 * 0.6 * 0.7 * 0.75 / 3])
    np.testing.assert_allclose(chain.scores[1:].numpy(), expected, rtol=1e-6)
    # When all three agree, the same path scores higher.
    agreeing = np.array([1, 2, 6, 8, 1, 2, 6, 8, 1, 2, 6, 8, 1, 2])
    higher = lookup_candidates(agreeing, node_budget=4, lookup_accept=DOC_ACCEPT)
    assert higher.tokens[:3].tolist() == [2, 6, 8]
    assert bool((higher.scores[1:3] > chain.scores[1:3]).all())
    # A path stops where fewer than LOOKUP_MIN_SHARE of the votes agree
    # (11 occurrences of "1 2", each followed by another token).
    spread = np.concatenate([np.array([[1, 2, t, 50 + t] for t in range(3, 14)]).ravel(),
                             [1, 2]])
    lone = lookup_candidates(spread, node_budget=4, lookup_accept=DOC_ACCEPT)
    assert 1 / 11 < LOOKUP_MIN_SHARE and lone is None


def test_a_path_runs_past_its_context_without_changing_which_context_wins():
    # One earlier "9", after "5" (1 token of context with the history's
    # end "1 9"), followed by 20 21 ... 29: the path takes 1 + LOOKUP_EXTEND
    # of them, short of the node budget, its scores falling with q.
    history = np.array([5, 9] + list(range(20, 30)) + [1, 9])
    budget = 1 + LOOKUP_EXTEND + 3
    chain = lookup_candidates(history, node_budget=budget, lookup_accept=DOC_ACCEPT)
    assert chain.tokens[1:].tolist() == list(range(20, 20 + 1 + LOOKUP_EXTEND))
    accept = np.array(DOC_ACCEPT)[np.minimum(np.arange(1, 2 + LOOKUP_EXTEND),
                                             len(DOC_ACCEPT) - 1)]
    np.testing.assert_allclose(chain.scores[1:].exp().numpy(), np.cumprod(accept),
                               rtol=1e-5)
    # Which context wins is decided on its first m tokens only. History
    # ending "7 8 9": "7 8 9" occurred once (3 tokens of context), followed
    # by 1 and the history's end (7 8 9): a path of 4, total share 3 over its
    # first 3. "5 9" occurred five times (1 token), each followed by
    # 3 4 5 6 0: share 5/6 on each of 1 + LOOKUP_EXTEND tokens, 5/6 over its
    # first. Counting the tokens past the context, the 1-token path (5 *
    # 5/6 > 4) would have won.
    history = np.array([5, 9, 3, 4, 5, 6, 0] * 5 + [7, 8, 9, 1, 7, 8, 9])
    assert LOOKUP_EXTEND >= 4
    chain = lookup_candidates(history, node_budget=8, lookup_accept=DOC_ACCEPT)
    assert chain.tokens[1:].tolist() == [1, 7, 8, 9]


def test_the_better_source_comes_first_and_the_other_may_follow():
    corpus = AnswerCorpus(64)
    corpus.add([3, 4, 5, 6, 7, 8])
    corpus.add([0, 4, 5, 6, 7, 8])
    # Own history: "4 5" -> 1 once (2 tokens of context; the path runs on
    # past them, 1 2 3 4, but only 1 2 count toward its total share, 2);
    # corpus: "3 4 5" -> 6 7 8 (3 tokens, total 3), a fully agreeing path
    # that stops at the answer's end.
    history = np.array([4, 5, 1, 2, 3, 4, 5])
    first, second = lookup_chains(history, node_budget=4, max_chains=2,
                                  lookup_accept=DOC_ACCEPT, corpus=corpus.tokens)
    assert first.tokens[1:].tolist() == [6, 7, 8]
    assert second.tokens[1:].tolist() == [1, 2, 3, 4]
    # The default is the better chain alone.
    (only,) = lookup_chains(history, node_budget=4, lookup_accept=DOC_ACCEPT,
                            corpus=corpus.tokens)
    assert only.tokens.tolist() == first.tokens.tolist()


@pytest.mark.parametrize("seed", range(10))
def test_merge_shares_prefix_and_keeps_larger_score(seed):
    mask = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed))
    tree = esp_candidates(mask, 4, root_token=0)
    first = int(tree.tokens[1])  # most probable level-1 candidate
    # A second chain token that is not an ESP child of `first`.
    children = set(tree.tokens[tree.parents == 1].tolist())
    second = next(t for t in range(1, VOCAB) if t not in children and t != first)
    # "12 0" occurred before: 2 tokens of context; a 2-token chain (the
    # node budget).
    chain = lookup_candidates(np.array([12, 0, first, second, 12, 0]), node_budget=2)
    merged = merge_candidates(tree, chain)
    shared = int(torch.nonzero((merged.parents == 0) & (merged.tokens == first))[0, 0])
    assert shared == 1
    assert merged.scores[1] == max(tree.scores[1], chain.scores[1])
    # The rest of the chain hangs below the shared node, once.
    assert merged.num_candidates == tree.num_candidates + 1
    assert merged.parents[-1].item() == 1 and merged.depths[-1].item() == 2
    assert merged.tokens[-1].item() == second


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


def _most_frequent_path(history, budget, max_context=LOOKUP_MAX_CONTEXT):
    """Brute force of the lookup path (``frequency_path_kernel``): the
    earlier occurrences of the last token, each with the context it shares
    with the end; for every context length m, the occurrences sharing at
    least m vote token by token for at most m + LOOKUP_EXTEND tokens while
    the agreeing share is >= LOOKUP_MIN_SHARE; the largest total share of
    the first m tokens wins."""
    history = history.tolist()
    size = len(history)

    def context(start):
        length = 1
        while (length < max_context and start - length - 1 >= 0
               and history[start - length - 1] == history[size - length - 1]):
            length += 1
        return length

    starts = [i + 1 for i in range(size - 1) if history[i] == history[-1]]
    # The order lookup lists them in: longest context, then most recent.
    listed = sorted(starts, key=lambda start: (-context(start), -start))[:LOOKUP_MAX_PEERS]
    best, best_total = [], 0.0
    for m in sorted({context(start) for start in listed}, reverse=True):
        members = [start for start in listed if context(start) >= m]
        path, total = [], 0.0
        for d in range(min(budget, m + LOOKUP_EXTEND)):
            votes = [history[start + d] for start in members
                     if start + d < size and history[start:start + d] == path]
            if not votes:
                break
            # Most votes; among ties the one listed first.
            token = max(votes, key=lambda t: (votes.count(t), -votes.index(t)))
            share = votes.count(token) / len(members)
            if share < LOOKUP_MIN_SHARE:
                break
            path.append(token)
            total += share if d < m else 0.0
        if total > best_total:
            best, best_total = path, total
    return best


@pytest.mark.parametrize("seed", range(40))
def test_ngram_only_is_the_most_frequent_path(seed):
    generator = np.random.default_rng(seed)
    history = generator.integers(0, 4, size=int(generator.integers(2, 80)))
    budget = int(generator.integers(1, 12))
    config = ESPConfig.from_dict({"block_complexity": 2 * (budget + 1),
                                  "candidates": ["ngram"]})
    assert config.node_budget == budget
    context = ProposalContext(history, int(history[-1]))
    hybrid = candidate_source(config).propose(context)
    expected = _most_frequent_path(history, budget)
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
    # The path after the 5-token context (its only member, share 1) beats
    # the one voted by both occurrences (3 tokens of context; 4 and 6 tie).
    (first,) = lookup_chains(history, node_budget=2)
    assert first.tokens[1:].tolist() == [4, 5]
    np.testing.assert_allclose(
        first.scores[1:].exp().numpy(), np.cumprod(LOOKUP_ACCEPT[5:7]), rtol=1e-5)
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
    # Request 0's chain comes from the cache, request 1's ("4" -> 5 9 4)
    # from its own history.
    assert trees.tokens[0, :3].tolist() == [5, 6, 7]
    assert trees.sources[0, 1:3].tolist() == [SOURCE_CORPUS] * 2
    # (1 token of context, so its total share is its first token's; the
    # cache's "4 5 6 7" ties, and the request's own history wins ties. Past
    # the context the own path goes on, to the node budget: 5 9.)
    assert proposer.hybrid.node_budget == 2
    assert trees.tokens[1, :3].tolist() == [4, 5, 9]
    assert trees.sources[1, 1:3].tolist() == [SOURCE_LOOKUP] * 2
    assert propose(None).num_nodes.tolist() == [0, 3]
    # Requests left out of the cache (seeded ones) see only their own history.
    assert propose(corpus.tokens, np.array([False, True])).num_nodes.tolist() == [0, 3]


def test_answer_pools_keep_each_cache_salt_apart_with_its_own_budget():
    pools = AnswerPools(8)
    pools.add("a", [5, 6])
    pools.add(None, [7])
    # The docstring's example: one array, each pool once, a span per request.
    tokens, starts, ends = pools.corpus(["a", None, "b", "a"])
    assert tokens.tolist() == [5, 6, -1, 7, -1]
    assert starts.tolist() == [0, 3, 0, 0] and ends.tolist() == [3, 5, 0, 3]
    assert pools.tokens("a").tolist() == [5, 6, -1]
    assert pools.tokens(None).tolist() == [7, -1]
    assert pools.tokens("b").size == 0
    # Another tenant's volume does not evict this one's answers: each pool
    # has the whole budget.
    for _ in range(10):
        pools.add("b", [1, 2, 3])
    assert pools.tokens("a").tolist() == [5, 6, -1]
    assert pools.tokens("b").tolist() == [1, 2, 3, -1, 1, 2, 3, -1]
    off = AnswerPools(0)
    off.add("a", [1, 2])
    assert len(off) == 0 and off.tokens("a").size == 0


def test_answer_pools_drop_the_least_recently_seen_and_idle_salts():
    now = [0.0]
    pools = AnswerPools(16, max_pools=2, max_idle=100.0, clock=lambda: now[0])
    pools.add("a", [1])
    pools.add("b", [2])
    now[0] = 10.0
    pools.corpus(["a"])  # a request of "a" proposed for: "a" was seen
    pools.add("c", [3])  # a third pool: "b", seen least recently, goes
    assert "a" in pools and "c" in pools and "b" not in pools
    now[0] = 105.0  # "a" seen at 10, "c" at 10: both idle 95 s
    pools.corpus(["c"])
    now[0] = 111.0  # "a" idle 101 s: dropped at the next call
    pools.corpus([None])
    assert "a" not in pools and "c" in pools
    assert pools.tokens("c").tolist() == [3, -1]


def test_each_request_drafts_only_from_its_own_salts_answers():
    config = ESPConfig.from_dict({"block_complexity": 6, "candidates": ["ngram"]})
    proposer = TreeProposer(config)
    pools = AnswerPools(64)
    pools.add("a", [1, 2, 3, 4, 5, 6, 7])
    pools.add("b", [3, 4, 5, 0, 0])
    # The same history for three requests of salts "a", "b" and "c":
    # "3 4 5" occurs only in earlier answers.
    histories = np.tile(np.array([8, 3, 4, 5]), (3, 1))
    cand = np.zeros((3, 1, proposer.candidate_width))
    corpus, starts, ends = pools.corpus(["a", "b", "c"])
    trees = proposer.propose(histories, np.arange(3), np.zeros(3, np.int64),
                             np.full(3, 4), histories[:, -1].copy(), cand.astype(np.int64),
                             cand.astype(np.float32), np.zeros(3, np.bool_), 16,
                             corpus=corpus, corpus_spans=(starts, ends))
    assert trees.tokens[0, :3].tolist() == [5, 6, 7]  # from "a"'s answer
    assert trees.tokens[1, :3].tolist() == [5, 0, 0]  # from "b"'s answer
    assert trees.num_nodes[2] == 0  # "c" has no answers: nothing to draft
    assert trees.sources[:2, 1:3].tolist() == [[SOURCE_CORPUS] * 2] * 2


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
    # "5 6" occurred before: 2 tokens of context, then the path runs on to
    # the history's end.
    match = source.propose(ProposalContext([5, 6, 7, 5, 6], 6))
    assert match.draft_tokens.tolist() == [7, 5, 6]
    assert match.tree_spec.num_mask_tokens == 1


def test_budget_goes_to_the_more_likely_source():
    # The 6-token context occurred twice, followed by 4 5 6 7 2 3 30 and
    # (more recently) 4 5 8 31 32 33 34: a chain whose estimates halve
    # after "4 5" (its 7th token is past the context).
    context = [20, 21, 22, 23, 24, 25]
    history = np.array(context + [4, 5, 6, 7, 2, 3, 30] + context
                       + [4, 5, 8, 31, 32, 33, 34] + context)
    chain = (4, 5, 8, 31, 32, 33, 34)
    flat = torch.zeros(1, 40)  # ESP knows nothing: uniform masks
    tree = hybrid_next_tree(history, 25, flat, block_size=8, num_mask_tokens=1,
                            candidates=("esp", "ngram"), mask_value=0.3)
    # Every node is the chain's (none of ESP's uniform candidates), and it
    # gets most of the block.
    assert _paths(tree) <= {chain[:d] for d in range(1, 8)}
    assert chain[:5] in _paths(tree)
    # A confident mask beats the chain's weaker deeper tokens, not its first.
    confident = _mask_logits({11: 0.97}, vocab=40)
    tree = hybrid_next_tree(history, 25, confident, block_size=6, num_mask_tokens=1,
                            candidates=("esp", "ngram"), mask_value=0.3)
    assert (11,) in _paths(tree) and chain[:2] in _paths(tree)
    assert chain[:5] not in _paths(tree)


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


