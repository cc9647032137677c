# SPDX-License-Identifier: Apache-2.0
"""Verification: greedy on hand-built trees, and losslessness of sampling."""

from __future__ import annotations

import hashlib

import pytest
import torch

from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import TreeSpec, chain_tree, static_tree
from vllm_esp_dev.verify import (
    chain_rejection_sample,
    chain_verify_sampling,
    greedy_verify,
    sample_and_match,
    select_chain,
)

V = 10
THE, CAT, DOG, SAT, RAN, ON = range(6)


def _one_hot_logits(argmaxes, vocab=V):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def _docstring_tree():
    return DraftTree(TreeSpec((-1, 0, 0, 1), num_mask_tokens=1),
                     torch.tensor([THE, CAT, DOG, SAT]))


def test_greedy_worked_example():
    result = greedy_verify(_docstring_tree(), _one_hot_logits([CAT, SAT, RAN, ON]))
    assert result.accepted_path.tolist() == [0, 1, 3]
    assert result.emitted_tokens == [CAT, SAT, ON]
    assert result.bonus_token == ON and result.last_node == 3 and result.num_accepted == 2


def test_greedy_second_branch_and_rejection():
    tree = _docstring_tree()
    result = greedy_verify(tree, _one_hot_logits([DOG, SAT, RAN, ON]))
    assert result.accepted_path.tolist() == [0, 2] and result.emitted_tokens == [DOG, RAN]
    result = greedy_verify(tree, _one_hot_logits([ON, SAT, RAN, ON]))
    assert result.accepted_path.tolist() == [0] and result.emitted_tokens == [ON]
    # Node 1 accepted but its argmax is not its child's token: bonus at node 1.
    result = greedy_verify(tree, _one_hot_logits([CAT, RAN, RAN, ON]))
    assert result.emitted_tokens == [CAT, RAN] and result.last_node == 1


def test_greedy_duplicate_siblings_take_lowest_index():
    tree = DraftTree(static_tree([3]), torch.tensor([CAT, CAT, CAT, CAT]))  # placeholder-like
    result = greedy_verify(tree, _one_hot_logits([CAT, SAT, RAN, ON]))
    assert result.accepted_path.tolist() == [0, 1] and result.emitted_tokens == [CAT, SAT]


def test_greedy_root_only_and_chain():
    result = greedy_verify(DraftTree(chain_tree(0), torch.tensor([THE])), _one_hot_logits([RAN]))
    assert result.accepted_path.tolist() == [0] and result.emitted_tokens == [RAN]
    chain = DraftTree(chain_tree(3), torch.tensor([THE, CAT, SAT, ON]))
    result = greedy_verify(chain, _one_hot_logits([CAT, SAT, ON, DOG]))
    assert result.emitted_tokens == [CAT, SAT, ON, DOG] and result.num_accepted == 3


def test_greedy_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        greedy_verify(_docstring_tree(), _one_hot_logits([CAT, SAT]))


def test_select_chain_follows_highest_child_logit():
    tree = DraftTree(TreeSpec((-1, 0, 0, 1, 2, 2), 0),
                     torch.tensor([THE, CAT, DOG, SAT, RAN, ON]))
    logits = torch.zeros(6, V)
    logits[0, DOG], logits[0, CAT] = 2.0, 1.0
    logits[2, ON], logits[2, RAN] = 3.0, 3.0        # tie: lower index (node 4, RAN)
    assert select_chain(tree, logits).tolist() == [0, 2, 4]
    assert select_chain(tree, torch.softmax(logits, -1)).tolist() == [0, 2, 4]


def test_chain_rejection_sample_extremes():
    g = torch.Generator().manual_seed(0)
    certain = torch.zeros(3, V)
    certain[0, CAT] = certain[1, SAT] = certain[2, ON] = 1
    assert chain_rejection_sample(torch.tensor([CAT, SAT]), certain, g) == (2, [CAT, SAT, ON])
    impossible = torch.full((2, V), 1.0 / (V - 1))
    impossible[0, DOG] = 0
    for _ in range(50):
        num_accepted, emitted = chain_rejection_sample(torch.tensor([DOG]), impossible, g)
        assert num_accepted == 0 and len(emitted) == 1 and emitted[0] != DOG


def test_sample_and_match_with_sample_fn():
    tree = _docstring_tree()
    draws = {0: CAT, 1: SAT, 3: ON}
    result = sample_and_match(tree, sample_fn=lambda node: draws[node])
    assert result.accepted_path.tolist() == [0, 1, 3] and result.emitted_tokens == [CAT, SAT, ON]


# ---------------------------------------------------------------- losslessness
SMALL_V = 8


def _target(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed, context-dependent 'model' over SMALL_V tokens."""
    seed = int.from_bytes(hashlib.sha256(repr(context).encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(SMALL_V, generator=g, dtype=torch.float64) * 1.5, -1)


def _node_probs(tree: DraftTree, context: tuple[int, ...]) -> torch.Tensor:
    spec, tokens = tree.tree_spec, tree.tokens.tolist()
    paths = [context]
    for node in range(1, spec.num_nodes):
        paths.append(paths[spec.parents[node]] + (tokens[node],))
    return torch.stack([_target(p) for p in paths])


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value, pooling cells with expected count < 5."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         stat / 2.0))


# The drafted tokens are picked to include the two most likely tokens at the
# root (so both acceptance and rejection happen often) plus unlikely ones.
CONTEXT = (3, 1)


def _test_tree():
    p0 = _target(CONTEXT)
    top = p0.argsort(descending=True).tolist()
    first = top[0]
    p1 = _target(CONTEXT + (first,))
    second = p1.argsort(descending=True).tolist()[0]
    spec = TreeSpec((-1, 0, 0, 0, 1, 1), num_mask_tokens=0)
    tokens = [CONTEXT[-1], first, top[1], top[-1], second, p1.argsort().tolist()[0]]
    return DraftTree(spec, torch.tensor(tokens))


@pytest.mark.parametrize("method", ["chain", "sample_and_match"])
def test_sampling_is_lossless_statistically(method):
    """First two emitted tokens follow the target's joint distribution.

    If a step emits a single token, the second one is drawn from the target
    directly (that is what the next step would verify against). 6000 trials,
    chi-square over the 64 (x1, x2) cells; fail only if p < 1e-3.
    """
    tree = _test_tree()
    node_probs = _node_probs(tree, CONTEXT)
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(SMALL_V, SMALL_V, dtype=torch.float64)
    first_level_accepts = 0
    for _ in range(6000):
        if method == "chain":
            result = chain_verify_sampling(tree, node_probs, g)
        else:
            result = sample_and_match(tree, node_probs, g)
        x = result.emitted_tokens
        if len(x) == 1:
            x = x + [int(torch.multinomial(_target(CONTEXT + (x[0],)), 1, generator=g))]
        else:
            first_level_accepts += 1
        counts[x[0], x[1]] += 1
    p0 = _target(CONTEXT)
    joint = torch.stack([p0[a] * _target(CONTEXT + (a,)) for a in range(SMALL_V)])
    assert _chi_square_p_value(counts.flatten(), joint.flatten()) > 1e-3
    assert _chi_square_p_value(counts.sum(1), p0) > 1e-3
    # Sanity: the tree really is exercised both ways.
    assert 500 < first_level_accepts < 5500
