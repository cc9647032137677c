# SPDX-License-Identifier: Apache-2.0
"""Batched ESP (core.batch) against the per-request algorithms.

The engine proposes, lays out and reduces the trees of a whole batch in one
call; the reference decoder and the worked examples use the per-request
functions. Both must give the same trees, layouts and chains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.batch import (
    TreeBatch,
    TreeProposer,
    block_layouts,
    chain_rows,
    chain_trees,
    child_score_indices,
    select_chains,
    select_chains_flat,
)
from vllm_esp.core.goodput import (
    NUM_REACH_BUCKETS,
    NUM_SAMPLING_BANDS,
    NUM_SOURCES,
    SOURCE_CORPUS,
    SOURCE_ESP,
    SOURCE_LOOKUP,
    reach_buckets,
    tally_verification,
)
from vllm_esp.core.proposal import DraftTree, mask_candidates
from vllm_esp.core.tree import TreeSpec, block_layout, chain_tree
from vllm_esp_dev.sources import ProposalContext, candidate_source
from vllm_esp_dev.verify import select_chain

CONFIGS = [
    {"tree": [4], "candidates": ["esp"]},
    {"tree": [3, 2], "candidates": ["esp"]},
    {"block_complexity": 12, "num_mask_tokens": 2, "candidates": ["esp"]},
    {"block_complexity": 10, "candidates": ["esp", "ngram"]},
    {"block_complexity": 30, "num_mask_tokens": 2, "candidates": ["esp", "ngram"]},
    {"block_complexity": 20, "candidates": ["ngram"]},
]


def _same_tree(a: DraftTree | None, b: DraftTree | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.tree_spec == b.tree_spec and a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: str(sorted(o.items())))
@pytest.mark.parametrize("seed", range(4))
def test_batch_proposal_equals_per_request_sources(options, seed):
    """A batch of requests with varied histories (repetitive or not), some
    with mask logits and some without (first step after prefill): the batch
    trees equal the per-request source's, request by request."""
    config = ESPConfig.from_dict(options)
    rng = np.random.default_rng(seed)
    vocab, batch = 30, 7
    k = config.num_mask_tokens
    lengths = rng.integers(3, 60, batch)
    # One shared token table, rows in shuffled order, with a prompt-embeds
    # style history start on one request.
    table = np.zeros((batch + 2, 80), np.int64)
    rows = rng.permutation(batch + 2)[:batch]
    starts = np.zeros(batch, np.int64)
    starts[0] = 2
    histories = []
    for i in range(batch):
        alphabet = 4 if i % 2 else vocab  # small alphabets repeat: lookup matches
        history = rng.integers(0, alphabet, lengths[i])
        table[rows[i], :lengths[i]] = history
        histories.append(history[starts[i]:])
    mask_logits = torch.from_numpy(rng.normal(size=(batch, k, vocab)) * 3).float()
    has = rng.random(batch) < 0.7
    proposer = TreeProposer(config)
    cand_tokens, cand_log_probs = mask_candidates(mask_logits, proposer.candidate_width)
    roots = np.array([h[-1] for h in histories], np.int64)
    trees = proposer.propose(table, rows, starts, lengths, roots, cand_tokens,
                             cand_log_probs, has, vocab)
    source = candidate_source(config)
    for i in range(batch):
        expected = source.propose(ProposalContext(
            histories[i], int(roots[i]), mask_logits[i] if has[i] else None))
        assert _same_tree(trees.tree(i), expected), f"request {i}"


def _random_tree(rng: np.random.Generator, k: int) -> DraftTree:
    size = int(rng.integers(1, 15))
    parents, depths = [-1], [0]
    for node in range(1, size):
        parents.append(int(rng.integers(node)))
        depths.append(depths[parents[-1]] + 1)
    order = sorted(range(size), key=lambda n: (depths[n], n))
    new_id = {old: new for new, old in enumerate(order)}
    parents = [-1] + [new_id[parents[old]] for old in order[1:]]
    masked = tuple(bool(m) for m in rng.random(size) < 0.5)
    spec = TreeSpec(tuple(parents), num_mask_tokens=k, masked=masked)
    return DraftTree(spec, torch.from_numpy(rng.integers(0, 50, size)))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_block_layouts_equal_per_tree_layouts(k):
    rng = np.random.default_rng(k)
    trees = [_random_tree(rng, k) for _ in range(12)]
    batch = TreeBatch.from_trees(trees, k)
    layouts = block_layouts(batch)
    for i, tree in enumerate(trees):
        layout = block_layout(tree.tree_spec)
        size = layout.block_size
        assert layouts.num_rows[i] == size
        np.testing.assert_array_equal(layouts.position_offsets[i, :size],
                                      layout.position_offsets.numpy())
        np.testing.assert_array_equal(layouts.attention_masks[i, :size, :size],
                                      layout.attention_mask.numpy())
        assert not layouts.attention_masks[i, size:].any()
        nodes = tree.num_nodes
        np.testing.assert_array_equal(layouts.depths[i, :nodes], layout.depths.numpy())
        if k:
            np.testing.assert_array_equal(layouts.mask_rows[i, :nodes, :k],
                                          layout.mask_rows.numpy())
    assert (batch.block_sizes() == layouts.num_rows).all()


def test_select_chains_equals_per_tree_chain():
    rng = np.random.default_rng(0)
    trees = [_random_tree(rng, 1) for _ in range(20)]
    batch = TreeBatch.from_trees(trees, 1)
    width = batch.parents.shape[1]
    child_scores = np.full((len(trees), width), -np.inf, np.float32)
    # The step's logits: every tree's node rows one after another.
    block_starts = np.cumsum([0] + [tree.num_nodes for tree in trees])[:-1]
    step_logits = []
    expected = []
    for i, tree in enumerate(trees):
        # Node logits with ties (few distinct values): lowest index wins.
        logits = torch.from_numpy(rng.integers(0, 3, (tree.num_nodes, 50))).float()
        step_logits.append(logits)
        expected.append(select_chain(tree, logits).tolist())
        parents = tree.tree_spec.parents
        for t in range(1, tree.num_nodes):
            child_scores[i, t] = logits[parents[t], tree.tokens[t]]
    chains, lengths = select_chains(batch, child_scores)
    assert [chains[i, :lengths[i]].tolist() for i in range(len(trees))] == expected
    # The runner's path: gather each node's score from the step's logits.
    rows, columns = child_score_indices(batch, block_starts)
    scores = torch.cat(step_logits)[torch.from_numpy(rows), torch.from_numpy(columns)]
    chains, lengths = select_chains_flat(batch, scores.numpy())
    assert [chains[i, :lengths[i]].tolist() for i in range(len(trees))] == expected


def test_chain_trees_are_their_own_chain_reduction():
    """A batch of chains (some blocks without a tree) needs no scores: the
    chain reduction of a chain is all of it. A batch where one tree
    branches gets None, so the runner gathers the scores."""
    rng = np.random.default_rng(3)
    chains_only = [None if n == 0 else
                   DraftTree(chain_tree(n - 1, 1), torch.from_numpy(rng.integers(0, 50, n)))
                   for n in (1, 4, 0, 9, 2)]
    batch = TreeBatch.from_trees(chains_only, 1)
    scores = rng.standard_normal(batch.parents.shape).astype(np.float32)
    expected_chains, expected_lengths = select_chains(batch, scores)
    chains, lengths = chain_trees(batch)
    np.testing.assert_array_equal(lengths, expected_lengths)
    np.testing.assert_array_equal(chains, expected_chains)
    branching = TreeBatch.from_trees(
        chains_only + [DraftTree(TreeSpec((-1, 0, 0), 1), torch.tensor([1, 2, 3]))], 1)
    assert chain_trees(branching) is None


def test_child_score_indices_docstring_example():
    batch = TreeBatch(np.array([[-1, 0, 1]]), np.array([[5, 9, 4]]),
                      np.zeros((1, 3), np.bool_), np.array([3]), 0)
    rows, columns = child_score_indices(batch, np.array([3]))
    assert rows.tolist() == [3, 4] and columns.tolist() == [9, 4]


def _reference_chain_rows(block_requests, logit_starts, vllm_num_drafts,
                          vllm_draft_tokens, chains, lengths, tree_tokens):
    """Request by request: (sampled rows, drafts) of each request."""
    per_request = []
    vllm_start = 0
    for r, start in enumerate(logit_starts):
        n = vllm_num_drafts[r]
        if r in block_requests:
            b = block_requests.index(r)
            chain = chains[b][:lengths[b]]
            per_request.append(([start + node for node in chain],
                                [tree_tokens[b][node] for node in chain[1:]]))
        else:
            per_request.append(([start + j for j in range(n + 1)],
                                list(vllm_draft_tokens[vllm_start:vllm_start + n])))
        vllm_start += n
    return per_request


def test_chain_rows_docstring_example():
    layout = chain_rows(np.array([1]), np.array([0, 3]), np.array([2, 9]),
                        np.array([7, 8] + [0] * 9), np.array([[0, 2, 0]]), np.array([2]),
                        np.array([[5, 9, 4]]), in_place=False)
    assert layout.rows.tolist() == [0, 1, 2, 3, 5]
    assert layout.draft_token_ids.tolist() == [7, 8, 4]
    assert layout.target_logits_indices.tolist() == [0, 1, 3]
    assert layout.bonus_logits_indices.tolist() == [2, 4]
    assert layout.logits_indices.tolist() == [0, 1, 2, 3, 4]
    in_place = chain_rows(np.array([1]), np.array([0, 3]), np.array([2, 9]),
                          np.array([7, 8] + [0] * 9), np.array([[0, 2, 0]]), np.array([2]),
                          np.array([[5, 9, 4]]), in_place=True)
    assert in_place.target_logits_indices.tolist() == [0, 1, 3]
    assert in_place.bonus_logits_indices.tolist() == [2, 5]
    assert in_place.logits_indices.tolist() == [0, 1, 2, 3, 5]


def test_chain_rows_lay_out_blocks_and_plain_requests_as_vllm_reads_them():
    rng = np.random.default_rng(3)
    for _ in range(30):
        num_requests = int(rng.integers(1, 7))
        trees = [_random_tree(rng, 1) for _ in range(num_requests)]
        batch = TreeBatch.from_trees(trees, 1)
        block_requests = sorted(rng.choice(num_requests, int(rng.integers(0, num_requests + 1)),
                                           replace=False).tolist())
        # A block's request scheduled its whole block as drafts (more than
        # its nodes); a plain request any number of drafts.
        vllm_num_drafts = rng.integers(0, 5, num_requests)
        for r in block_requests:
            vllm_num_drafts[r] = batch.block_sizes()[r] - 1 + int(rng.integers(0, 3))
        vllm_draft_tokens = rng.integers(0, 100, int(vllm_num_drafts.sum()))
        logit_starts = np.cumsum(vllm_num_drafts + 1) - (vllm_num_drafts + 1)
        scores = rng.standard_normal(batch.parents.shape).astype(np.float32)
        all_chains, all_lengths = select_chains(batch, scores)
        chains, lengths = all_chains[block_requests], all_lengths[block_requests]
        tokens = batch.tokens[block_requests]
        expected = _reference_chain_rows(block_requests, logit_starts, vllm_num_drafts,
                                         vllm_draft_tokens, chains.tolist(),
                                         lengths.tolist(), tokens.tolist())
        compact = chain_rows(np.array(block_requests, np.int64), logit_starts,
                             vllm_num_drafts, vllm_draft_tokens, chains, lengths, tokens,
                             in_place=False)
        in_place = chain_rows(np.array(block_requests, np.int64), logit_starts,
                              vllm_num_drafts, vllm_draft_tokens, chains, lengths, tokens,
                              in_place=True)
        assert compact.rows.tolist() == [row for rows, _ in expected for row in rows]
        assert compact.draft_token_ids.tolist() == [t for _, drafts in expected for t in drafts]
        assert compact.num_draft_tokens.tolist() == [len(d) for _, d in expected]
        assert compact.cu_num_draft_tokens.tolist() == np.cumsum(
            [len(d) for _, d in expected]).tolist()
        assert compact.cu_num_sampled_tokens.tolist() == np.cumsum(
            [len(rows) for rows, _ in expected]).tolist()
        # Compact indices point into logits[rows]; in-place ones into the
        # full logits, at the same rows.
        full = rng.standard_normal(int(logit_starts[-1] + vllm_num_drafts[-1] + 1))
        picked = full[compact.rows]
        for name in ("target_logits_indices", "bonus_logits_indices", "logits_indices"):
            np.testing.assert_array_equal(full[getattr(in_place, name)],
                                          picked[getattr(compact, name)], err_msg=name)
        assert compact.logits_indices.tolist() == list(range(compact.rows.shape[0]))
        for r, (rows, drafts) in enumerate(expected):
            end = compact.cu_num_sampled_tokens[r]
            assert compact.bonus_logits_indices[r] == end - 1
            start = compact.cu_num_draft_tokens[r] - len(drafts)
            assert compact.target_logits_indices[start:start + len(drafts)].tolist() == list(
                range(end - len(rows), end - 1))


def test_requests_without_a_tree_get_no_rows_and_no_chain():
    # A step may hold requests with no tree (num_nodes == 0) between ones
    # with a tree; the kernels must skip them without reading past them,
    # and the others' results must not change.
    rng = np.random.default_rng(7)
    trees = [_random_tree(rng, 1) for _ in range(4)]
    with_gaps = [None, trees[0], trees[1], None, trees[2], trees[3], None]
    full, gapped = TreeBatch.from_trees(trees, 1), TreeBatch.from_trees(with_gaps, 1)
    empty = [i for i, tree in enumerate(with_gaps) if tree is None]
    kept = [i for i, tree in enumerate(with_gaps) if tree is not None]

    layouts, reference = block_layouts(gapped), block_layouts(full)
    assert layouts.num_rows[empty].tolist() == [0, 0, 0]
    assert not layouts.attention_masks[empty].any()
    rows = reference.position_offsets.shape[1]
    np.testing.assert_array_equal(layouts.num_rows[kept], reference.num_rows)
    np.testing.assert_array_equal(layouts.attention_masks[kept][:, :rows, :rows],
                                  reference.attention_masks)

    scores = rng.standard_normal(gapped.parents.shape).astype(np.float32)
    chains, lengths = select_chains(gapped, scores)
    reference_chains, reference_lengths = select_chains(full, scores[kept])
    assert lengths[empty].tolist() == [0, 0, 0]
    np.testing.assert_array_equal(lengths[kept], reference_lengths)
    for tree_index, row in enumerate(kept):
        assert (chains[row, :lengths[row]].tolist()
                == reference_chains[tree_index, :reference_lengths[tree_index]].tolist())


def test_tally_names_the_drafted_and_the_accepted_nodes_per_band_and_source():
    # Block 0 (greedy): root -> a (ESP) -> b (lookup), root -> c (lookup).
    # Block 1 (band 2): no tree. Block 2 (band 2): root -> d (cached answers).
    sources = np.array([[0, SOURCE_ESP, SOURCE_LOOKUP, SOURCE_LOOKUP], [0] * 4,
                        [0, SOURCE_CORPUS, 0, 0]], np.int8)
    reach = np.array([[1.0, 0.6, 0.3, 0.05], [0.0] * 4, [1.0, 0.15, 0.0, 0.0]], np.float32)
    chains = np.array([[0, 1, 2, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    bands = np.array([0, 2, 2])
    num_nodes = np.array([4, 0, 2])

    # a accepted, b rejected; d rejected; block 0's last node had masks.
    tally = tally_verification(num_nodes, sources, reach, chains, np.array([1, 0, 0]),
                               bands, np.array([True, False, False]))
    assert tally.present.tolist() == [True, False, True, False]
    assert tally.drafted.tolist() == [3, 0, 1, 0]
    assert tally.probed.tolist() == [1, 0, 0, 0]
    assert tally.esp_drafted.tolist() == [1, 0, 0, 0]
    assert tally.esp_accepted.tolist() == [1, 0, 0, 0]
    assert tally.drafted_by_source.tolist() == [1, 2, 1]
    assert tally.accepted_by_source.tolist() == [1, 0, 0]
    # Cells of prior reach: 0.6 -> the last, 0.3 -> the third, 0.05 -> the
    # first, 0.15 -> the second.
    assert tally.predicted[0, SOURCE_ESP].tolist() == pytest.approx([0, 0, 0, 0, 0.6])
    assert tally.predicted[0, SOURCE_LOOKUP].tolist() == pytest.approx([0.05, 0, 0.3, 0, 0])
    assert tally.predicted[2, SOURCE_CORPUS].tolist() == pytest.approx([0, 0.15, 0, 0, 0])
    assert tally.accepted[0, SOURCE_ESP].tolist() == [0, 0, 0, 0, 1]
    assert tally.accepted.sum() == 1

    # Both accepted in block 0, d accepted in block 2.
    tally = tally_verification(num_nodes, sources, reach, chains, np.array([2, 0, 1]),
                               bands, np.zeros(3, np.bool_))
    assert tally.accepted_by_source.tolist() == [1, 1, 1]
    assert tally.accepted[2, SOURCE_CORPUS, 1] == 1


def test_tally_matches_per_node_numpy_counts_on_random_trees():
    """The compiled tally against the per-node numpy computation it
    replaced (drafted and on-path masks, then bincounts per band)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch, width = int(rng.integers(1, 9)), int(rng.integers(1, 10))
        num_nodes = rng.integers(0, width + 1, batch)
        sources = rng.integers(0, NUM_SOURCES, (batch, width)).astype(np.int8)
        reach = rng.random((batch, width)).astype(np.float32)
        chains = np.zeros((batch, width), np.int64)
        accepted = np.zeros(batch, np.int64)
        for block in range(batch):
            path = rng.permutation(np.arange(1, max(num_nodes[block], 1)))
            depth = int(rng.integers(0, path.size + 1))
            chains[block, 1:1 + depth] = path[:depth]
            accepted[block] = rng.integers(0, depth + 1)
        bands = rng.integers(0, NUM_SAMPLING_BANDS, batch)
        probed = rng.random(batch) < 0.5

        tally = tally_verification(num_nodes, sources, reach, chains, accepted, bands,
                                   probed)

        drafted = np.arange(width)[None, :] < num_nodes[:, None]
        drafted[:, 0] = False
        on_path = np.zeros_like(drafted)
        for block in range(batch):
            on_path[block, chains[block, 1:accepted[block] + 1]] = True
        cells = (sources.astype(np.int64) * NUM_REACH_BUCKETS
                 + reach_buckets(reach.astype(np.float64)))
        size = NUM_SOURCES * NUM_REACH_BUCKETS
        for band in range(NUM_SAMPLING_BANDS):
            rows = (bands == band)[:, None] & drafted
            assert tally.present[band] == (bands == band).any()
            assert tally.drafted[band] == rows.sum()
            np.testing.assert_allclose(
                tally.predicted[band].ravel(),
                np.bincount(cells[rows], weights=reach[rows].astype(np.float64),
                            minlength=size), rtol=1e-12)
            np.testing.assert_array_equal(
                tally.accepted[band].ravel(),
                np.bincount(cells[rows & on_path], minlength=size))
            assert tally.probed[band] == probed[bands == band].sum()
            esp = rows & (sources == SOURCE_ESP)
            assert tally.esp_drafted[band] == esp.sum()
            assert tally.esp_accepted[band] == (esp & on_path).sum()
        np.testing.assert_array_equal(
            tally.drafted_by_source, np.bincount(sources[drafted], minlength=NUM_SOURCES))
        np.testing.assert_array_equal(
            tally.accepted_by_source,
            np.bincount(sources[drafted & on_path], minlength=NUM_SOURCES))
