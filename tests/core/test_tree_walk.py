# SPDX-License-Identifier: Apache-2.0
"""The tree walk (``core.tree_walk``): the forest of a step, the walk, and
that what it emits has exactly the target's distribution."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_esp.core.tree_walk import children_with_tokens, verification_forest, walk
from vllm_esp_dev.stats import chi_square_goodness_p


def test_forest_of_the_docstring_example():
    # Request 0: drafts [7, 8] (a chain); request 1: tree 5 -> {9, 4}.
    forest = verification_forest(
        logit_starts=np.array([0, 3]), block_requests=np.array([1]),
        tree_parents=np.array([[-1, 0, 0]]), tree_tokens=np.array([[5, 9, 4]]),
        tree_num_nodes=np.array([3]), num_drafts=np.array([2, 2]),
        draft_tokens=np.array([7, 8, 0, 0]))
    assert forest.node_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert forest.node_starts.tolist() == [0, 3, 6]
    assert forest.tokens[[1, 2, 4, 5]].tolist() == [7, 8, 9, 4]
    assert forest.first_child.tolist() == [1, 2, -1, 4, -1, -1]
    assert forest.next_sibling.tolist() == [-1, -1, -1, -1, 5, -1]
    assert forest.max_depth == 2


def test_children_with_tokens_takes_the_first_child_of_a_repeated_token():
    # Placeholder trees repeat the root's token among siblings.
    forest = verification_forest(np.array([0]), np.array([0]), np.array([[-1, 0, 0, 0]]),
                                 np.array([[7, 7, 7, 3]]), np.array([4]), np.array([3]),
                                 np.zeros(3))
    nodes = np.array([0, 0, 0])
    assert children_with_tokens(forest.first_child, forest.next_sibling, forest.tokens,
                                nodes, np.array([7, 3, 5])).tolist() == [1, 3, -1]


def test_the_walk_emits_the_draws_along_the_accepted_path():
    # root -> {a=1, b=2}, a -> {c=3}: draws 1 at the root, 3 at a, 4 at c.
    forest = verification_forest(np.array([0]), np.array([0]), np.array([[-1, 0, 0, 1]]),
                                 np.array([[0, 1, 2, 3]]), np.array([4]), np.array([3]),
                                 np.zeros(3))
    draws = {0: 1, 1: 3, 3: 4}
    emitted, paths, lengths = walk(
        forest, lambda nodes, requests, level: np.array([draws[int(n)] for n in nodes]))
    assert lengths.tolist() == [3]
    assert emitted[0, :3].tolist() == [1, 3, 4] and paths[0, :3].tolist() == [0, 1, 3]


# --------------------------------------------------- the target distribution
VOCAB = 5
TOKENS = 3  # the emitted prefix whose distribution is checked
START = VOCAB  # "no token" in a context


def synthetic_logits(seed: int = 0) -> np.ndarray:
    """A toy model: the next token's logits depend on the last two tokens
    (``[previous, last, vocab]``, ``START`` for a missing one)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 1.5, (VOCAB + 1, VOCAB + 1, VOCAB))


def exact_distribution(logits: np.ndarray) -> dict[tuple, float]:
    """P(x1, x2, x3) of plain sampling from the toy model."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=TOKENS):
        context, p = [START, START], 1.0
        for token in seq:
            p *= probs[context[-2], context[-1], token]
            context.append(token)
        out[seq] = p
    return out


def draft_trees(logits, last_two):
    """Each request's tree for its context: the root's two most likely
    tokens (as a drafter would guess), a third child that repeats the
    first, and one grandchild under the second-best child. Tokens ``[R, 5]``,
    node contexts ``[R, 5, 2]``."""
    root_logits = logits[last_two[:, 0], last_two[:, 1]]
    order = np.argsort(-root_logits, axis=1, kind="stable")
    first, second = order[:, 0], order[:, 1]
    grandchild = np.argmax(logits[last_two[:, 1], second], axis=1)
    root_token = last_two[:, 1]
    tokens = np.stack([root_token, first, second, first, grandchild], axis=1)
    # The context each node's draw conditions on: its last two tokens.
    contexts = np.stack([
        last_two,
        np.stack([last_two[:, 1], first], 1),
        np.stack([last_two[:, 1], second], 1),
        np.stack([last_two[:, 1], first], 1),
        np.stack([second, grandchild], 1)], axis=1)
    return tokens, contexts


PARENTS = np.array([-1, 0, 0, 0, 2])


def speculative_samples(logits: np.ndarray, num_samples: int, seed: int,
                        draw_context=lambda contexts: contexts) -> list[tuple]:
    """``num_samples`` runs of speculative decoding with the walk until
    ``TOKENS`` tokens are out; ``draw_context`` may corrupt what a draw
    conditions on (the negative control)."""
    rng = np.random.default_rng(seed)
    emitted = np.full((num_samples, TOKENS + 3), -1)
    counts = np.zeros(num_samples, np.int64)
    last_two = np.full((num_samples, 2), START)
    while (counts < TOKENS).any():
        live = np.flatnonzero(counts < TOKENS)
        tokens, contexts = draft_trees(logits, last_two[live])
        size = len(PARENTS)
        forest = verification_forest(
            np.arange(live.size) * size, np.arange(live.size),
            np.tile(PARENTS, (live.size, 1)), tokens, np.full(live.size, size),
            np.zeros(live.size, np.int64), np.zeros(0))
        node_contexts = draw_context(contexts).reshape(-1, 2)

        def draw(nodes, requests, level, node_contexts=node_contexts):
            rows = logits[node_contexts[nodes, 0], node_contexts[nodes, 1]]
            return np.argmax(rows + rng.gumbel(size=rows.shape), axis=1)

        step, _, lengths = walk(forest, draw)
        for i, request in enumerate(live):
            out = step[i, :lengths[i]]
            emitted[request, counts[request]:counts[request] + out.size] = out
            counts[request] += out.size
            history = [START, START] + emitted[request, :counts[request]].tolist()
            last_two[request] = history[-2:]
    return [tuple(row[:TOKENS]) for row in emitted]


NUM_SAMPLES = 60_000


def test_the_walk_samples_the_target_distribution():
    logits = synthetic_logits()
    samples = speculative_samples(logits, NUM_SAMPLES, seed=1)
    assert chi_square_goodness_p(samples, exact_distribution(logits)) > 1e-3


def test_the_check_sees_a_walk_that_draws_from_the_wrong_context():
    # A walk that draws a child's token from its parent's distribution (the
    # kind of slip a wrong logits row makes) is caught.
    logits = synthetic_logits()

    def parents_context(contexts):
        wrong = contexts.copy()
        wrong[:, 1:4] = contexts[:, :1]
        return wrong

    samples = speculative_samples(logits, NUM_SAMPLES, seed=1, draw_context=parents_context)
    assert chi_square_goodness_p(samples, exact_distribution(logits)) < 1e-6


def test_the_check_sees_a_one_percent_shift():
    # The power the issue asks for: a 1% shift of one sequence's mass.
    logits = synthetic_logits()
    expected = exact_distribution(logits)
    rng = np.random.default_rng(2)
    sequences = list(expected)
    shifted = dict(expected)
    common = max(expected, key=expected.get)
    rare = min(expected, key=expected.get)
    shifted[common] -= 0.01
    shifted[rare] += 0.01
    picks = rng.choice(len(sequences), size=NUM_SAMPLES, p=np.array(list(shifted.values())))
    assert chi_square_goodness_p([sequences[i] for i in picks], expected) < 1e-3


@pytest.mark.parametrize("seed", [0, 3])
def test_greedy_draws_walk_the_greedy_continuation(seed):
    logits = synthetic_logits(seed)
    tokens, contexts = draft_trees(logits, np.full((1, 2), START))
    forest = verification_forest(np.array([0]), np.array([0]), PARENTS[None], tokens,
                                 np.array([5]), np.array([4]), np.zeros(4))
    node_contexts = contexts.reshape(-1, 2)
    emitted, _, lengths = walk(forest, lambda nodes, requests, level: np.argmax(
        logits[node_contexts[nodes, 0], node_contexts[nodes, 1]], axis=1))
    greedy, context = [], [START, START]
    for _ in range(lengths[0]):
        greedy.append(int(np.argmax(logits[context[-2], context[-1]])))
        context.append(greedy[-1])
    # The root's argmax is always its first child: at least one accepted.
    assert lengths[0] >= 2 and emitted[0, :lengths[0]].tolist() == greedy
