# SPDX-License-Identifier: Apache-2.0
"""Next-tree construction: static top-1 expansion, dynamic best-first, placeholder."""

from __future__ import annotations

import pytest
import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.proposal import (
    DraftTree,
    dynamic_next_tree,
    next_tree,
    placeholder_tree,
    static_next_tree,
)
from vllm_esp.core.tree import static_tree


def _logits_from_probs(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_static_next_tree_worked_example():
    # Module docstring example: V = 16, root token 7.
    probs = torch.full((2, 16), 1e-4)
    probs[0, [7, 12, 5, 9]] = torch.tensor([0.40, 0.30, 0.20, 0.05])
    probs[1, [12, 3, 8]] = torch.tensor([0.50, 0.30, 0.10])
    tree = static_next_tree(probs.log(), [3, 2], root_token=7)
    assert tree.tokens.tolist() == [7, 12, 5, 9, 3, 8]
    assert tree.tree_spec == static_tree([3, 2])
    assert tree.draft_tokens.tolist() == [12, 5, 9, 3, 8]


def test_static_next_tree_keeps_top_when_parent_absent():
    logits = _logits_from_probs([[0.1, 0.5, 0.3, 0.1]])
    assert static_next_tree(logits, [2], root_token=3).tokens.tolist() == [3, 1, 2]
    # Root token among the top: skipped, next best taken.
    assert static_next_tree(logits, [2], root_token=1).tokens.tolist() == [1, 2, 0]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("widths", [(4,), (29,), (15, 4), (3, 2, 1)])
def test_static_next_tree_properties(seed, widths):
    g = torch.Generator().manual_seed(seed)
    vocab = 40
    mask_logits = torch.randn(len(widths), vocab, generator=g) * 3
    root = int(torch.randint(vocab, (), generator=g))
    tree = static_next_tree(mask_logits, widths, root)
    spec = tree.tree_spec
    tokens = tree.tokens
    assert spec == static_tree(widths) and tokens[0] == root
    for node in range(1, spec.num_nodes):  # no child repeats its parent
        assert tokens[node] != tokens[spec.parents[node]]
    start = 1
    for level, width in enumerate(widths):
        level_tokens = tokens[start:start + width]
        parent_token = int(tokens[spec.parents[start]])
        allowed = [t for t in mask_logits[level].argsort(descending=True).tolist()
                   if t != parent_token]
        assert level_tokens.tolist() == allowed[:width]  # descending probability
        start += width


def _brute_force_top(mask_logits, budget, root):
    """All pruned paths of the unbounded tree, best ``budget`` by cumulative log-prob."""
    log_probs = torch.log_softmax(mask_logits.double(), -1)
    vocab = mask_logits.shape[1]
    scored = []
    frontier = [((root,), 0.0)]
    for level in range(mask_logits.shape[0]):
        nxt = []
        for path, score in frontier:
            for token in range(vocab):
                if token != path[-1]:
                    nxt.append((path + (token,), score + float(log_probs[level, token])))
        scored += nxt
        frontier = nxt
    scored.sort(key=lambda item: -item[1])
    return {path for path, _ in scored[:budget]}


def _paths(tree: DraftTree):
    spec, tokens = tree.tree_spec, tree.tokens.tolist()
    paths = [(tokens[0],)]
    for node in range(1, spec.num_nodes):
        paths.append(paths[spec.parents[node]] + (tokens[node],))
    return paths


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_tree_budget_closure_and_optimality(seed):
    g = torch.Generator().manual_seed(seed)
    k = 1 + seed % 3
    vocab = 6 + seed % 5
    budget = 1 + seed % 9
    mask_logits = torch.randn(k, vocab, generator=g) * (0.5 + seed % 4)
    root = int(torch.randint(vocab, (), generator=g))
    tree = dynamic_next_tree(mask_logits, budget, root)
    spec = tree.tree_spec
    assert spec.num_mask_tokens == k and tree.tokens[0] == root
    expected_paths = _brute_force_top(mask_logits, budget, root)
    assert spec.num_nodes == 1 + len(expected_paths)
    if vocab > budget:
        assert spec.num_nodes == budget + 1       # exactly B drafts
    assert spec.max_depth <= k
    # TreeSpec already enforces BFS order, so parents precede children:
    # the set is ancestor-closed by construction. Check pruning and scores.
    log_probs = torch.log_softmax(mask_logits.double(), -1)
    paths = _paths(tree)
    scores = [sum(float(log_probs[i, t]) for i, t in enumerate(p[1:])) for p in paths]
    for node in range(1, spec.num_nodes):
        parent = spec.parents[node]
        assert tree.tokens[node] != tree.tokens[parent]
        assert scores[node] <= scores[parent] + 1e-9
    for a, b in zip(range(1, spec.num_nodes - 1), range(2, spec.num_nodes)):
        if spec.depths[a] == spec.depths[b]:   # within a level: descending score
            assert scores[a] >= scores[b] - 1e-6
    assert set(paths[1:]) == expected_paths


def test_dynamic_tree_one_level_is_top_b():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    tree = dynamic_next_tree(logits, 9, root_token=int(logits[0].argmax()))
    expected = [t for t in logits[0].argsort(descending=True).tolist()
                if t != int(logits[0].argmax())][:9]
    assert tree.draft_tokens.tolist() == expected
    assert tree.tree_spec.parents == (-1,) + (0,) * 9


def test_placeholder_tree():
    static = placeholder_tree(ESPConfig(num_mask_tokens=2, tree=(15, 4)), 42)
    assert static.tree_spec == static_tree((15, 4))
    assert (static.tokens == 42).all()
    dynamic = placeholder_tree(ESPConfig(tree=None, block_complexity=30), 7)
    assert dynamic.tree_spec.parents == (-1,) + (0,) * 14
    assert dynamic.tree_spec.num_mask_tokens == 1 and (dynamic.tokens == 7).all()


def test_next_tree_dispatch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, generator=g)
    static_cfg = ESPConfig(num_mask_tokens=2, tree=(3, 1))
    dynamic_cfg = ESPConfig(num_mask_tokens=2, tree=None, block_complexity=30)
    assert next_tree(static_cfg, logits, 5).tree_spec == static_tree((3, 1))
    tree = next_tree(dynamic_cfg, logits, 5)
    assert tree.num_nodes == dynamic_cfg.num_nodes == 10
    assert tree.layout.block_size == dynamic_cfg.block_size


def test_draft_tree_validates_length():
    with pytest.raises(ValueError):
        DraftTree(static_tree([2]), torch.tensor([1, 2]))
