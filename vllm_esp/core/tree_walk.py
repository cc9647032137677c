# SPDX-License-Identifier: Apache-2.0
"""Tree verification by sampling: draw at the node, walk the tree.

Every request of a step is verified from its root (its last committed
token) by repeating one rule: draw the next token from the target's
distribution at the current node (after the request's own sampling
transforms: penalties along the path, temperature, top-k, top-p, ...); if a
child of the node carries the drawn token, that child is accepted and the
walk goes on from it; otherwise the drawn token is emitted and the walk
stops.

Every emitted token is a fresh draw from the target distribution given all
tokens before it, so the output has exactly the target's distribution,
whatever the drafts are. A level is accepted with probability equal to the
sum of its children's target probabilities: for deterministic drafts, the
most any lossless verifier can get (SpecInfer's multi-draft rejection
sampling and SGLang's target-only tree sampling reach the same). Reducing
the tree to one chain first, as vLLM's one-hot rejection sampler needs,
accepts a level only with the probability of the chosen child. With greedy
decoding the draw is the argmax, and the walk is exact greedy tree
verification.

A step is a *forest* (:class:`VerificationForest`): one tree per request,
flat. An ESP block contributes its tree, a request verifying plain drafts
contributes the chain of its drafts, and a request without drafts its root
alone.

Worked example, one request, tree ``root -> {a, b}``, ``a -> {c}``::

    level 0: draw at root -> b   b is a child: accept b
    level 1: draw at b    -> x   b has no child x: emit x, stop

    emitted [b, x], path [root, b]: one draft accepted, two tokens.

The walk runs one level at a time for all requests still walking (Python
per level, never per node); :func:`walk` takes the draw as a function so
that the engine's sampler (``vllm_esp.sampling``) and the tests share the
same walk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["VerificationForest", "verification_forest", "walk", "children_with_tokens"]


@dataclass
class VerificationForest:
    """One step's trees, flat: node ``n`` has logits row ``node_rows[n]``
    and token ``tokens[n]`` (a root's token is not read); its children are
    ``first_child[n]``, ``next_sibling[first_child[n]]``, ... (-1 ends);
    request ``r``'s nodes are ``node_starts[r] .. node_starts[r + 1] - 1``,
    its root first."""

    node_rows: np.ndarray     # [N] int64
    tokens: np.ndarray        # [N] int64
    first_child: np.ndarray   # [N] int64
    next_sibling: np.ndarray  # [N] int64
    node_starts: np.ndarray   # [R + 1] int64
    max_depth: int

    @property
    def num_requests(self) -> int:
        return int(self.node_starts.shape[0] - 1)

    @property
    def roots(self) -> np.ndarray:
        return self.node_starts[:-1]


@njit(cache=True)
def forest_kernel(logit_starts, block_of, tree_parents, tree_tokens, tree_num_nodes,
                  num_drafts, draft_starts, draft_tokens, out_rows, out_tokens,
                  out_first_child, out_next_sibling, out_node_starts):
    node = 0
    max_depth = 0
    for r in range(logit_starts.shape[0]):
        out_node_starts[r] = node
        b = block_of[r]
        size = tree_num_nodes[b] if b >= 0 else num_drafts[r] + 1
        for t in range(size):
            out_rows[node + t] = logit_starts[r] + t
            out_first_child[node + t] = -1
            out_next_sibling[node + t] = -1
            out_tokens[node + t] = -1
        # Children are linked in reverse so that each list ends up in node
        # order (the lowest index first).
        depth = np.zeros(size, np.int64)
        for t in range(size - 1, 0, -1):
            if b >= 0:
                parent = tree_parents[b, t]
                out_tokens[node + t] = tree_tokens[b, t]
            else:
                parent = t - 1
                out_tokens[node + t] = draft_tokens[draft_starts[r] + t - 1]
            out_next_sibling[node + t] = out_first_child[node + parent]
            out_first_child[node + parent] = node + t
        for t in range(1, size):
            parent = tree_parents[b, t] if b >= 0 else t - 1
            depth[t] = depth[parent] + 1
            if depth[t] > max_depth:
                max_depth = depth[t]
        node += size
    out_node_starts[logit_starts.shape[0]] = node
    return max_depth


def verification_forest(logit_starts: np.ndarray, block_requests: np.ndarray,
                        tree_parents: np.ndarray, tree_tokens: np.ndarray,
                        tree_num_nodes: np.ndarray, num_drafts: np.ndarray,
                        draft_tokens: np.ndarray) -> VerificationForest:
    """The step's forest. Request ``block_requests[b]`` verifies tree ``b``
    (``tree_parents[b]``, ``tree_tokens[b]``, ``tree_num_nodes[b]`` nodes in
    BFS order) from its logits rows ``logit_starts[r] + 0, 1, ...``; every
    other request ``r`` the chain of its ``num_drafts[r]`` drafts
    (consecutive in ``draft_tokens``), from the same rows.

    Example: two requests, logits rows from 0 and 3; request 0 has drafts
    ``[7, 8]``, request 1 the tree ``parents [-1, 0, 0], tokens [5, 9, 4]``:
    nodes ``0..2`` (rows 0, 1, 2: a chain) and ``3..5`` (rows 3, 4, 5), with
    ``first_child[3] = 4`` and ``next_sibling[4] = 5``."""
    num_requests = logit_starts.shape[0]
    block_of = np.full(num_requests, -1, np.int64)
    block_of[np.asarray(block_requests, np.int64)] = np.arange(len(block_requests))
    num_drafts = np.asarray(num_drafts, np.int64)
    sizes = num_drafts + 1
    sizes[np.asarray(block_requests, np.int64)] = tree_num_nodes
    total = int(sizes.sum())
    rows = np.empty(total, np.int64)
    tokens = np.empty(total, np.int64)
    first_child = np.empty(total, np.int64)
    next_sibling = np.empty(total, np.int64)
    node_starts = np.empty(num_requests + 1, np.int64)
    draft_starts = np.cumsum(num_drafts) - num_drafts
    max_depth = forest_kernel(
        np.asarray(logit_starts, np.int64), block_of,
        np.asarray(tree_parents, np.int64).reshape(len(block_requests), -1),
        np.asarray(tree_tokens, np.int64).reshape(len(block_requests), -1),
        np.asarray(tree_num_nodes, np.int64), num_drafts, draft_starts,
        np.asarray(draft_tokens, np.int64), rows, tokens, first_child, next_sibling,
        node_starts)
    return VerificationForest(rows, tokens, first_child, next_sibling, node_starts,
                              int(max_depth))


@njit(cache=True)
def children_with_tokens(first_child, next_sibling, tokens, nodes, drawn):
    """For each ``nodes[i]``, its first child carrying token ``drawn[i]``,
    or -1. (A later child with the same token is never chosen, so siblings
    that repeat a token cost rows but cannot bias the walk.)"""
    out = np.full(nodes.shape[0], -1, np.int64)
    for i in range(nodes.shape[0]):
        child = first_child[nodes[i]]
        while child >= 0:
            if tokens[child] == drawn[i]:
                out[i] = child
                break
            child = next_sibling[child]
    return out


# draw(nodes, requests, level) -> tokens: one draw from the target
# distribution at each node in ``nodes`` (of those requests; ``level`` tokens
# already emitted this step, which are its path's tokens).
DrawFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def walk(forest: VerificationForest, draw: DrawFn
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Verify every request of ``forest``. Returns ``emitted`` ``[R, D + 1]``
    (each request's tokens, -1 after its last), ``paths`` ``[R, D + 1]``
    (``paths[r, i]``: the node ``emitted[r, i]`` was drawn at; so
    ``paths[r, :lengths[r]]`` is the accepted path, root first) and
    ``lengths`` ``[R]`` (tokens emitted: accepted drafts + 1); ``D`` is the
    forest's greatest depth."""
    num_requests = forest.num_requests
    width = forest.max_depth + 1
    emitted = np.full((num_requests, width), -1, np.int64)
    paths = np.zeros((num_requests, width), np.int64)
    lengths = np.zeros(num_requests, np.int64)
    requests = np.arange(num_requests, dtype=np.int64)
    nodes = forest.roots.copy()
    level = 0
    while requests.size:
        drawn = np.asarray(draw(nodes, requests, level), np.int64)
        emitted[requests, level] = drawn
        paths[requests, level] = nodes
        children = children_with_tokens(forest.first_child, forest.next_sibling,
                                        forest.tokens, nodes, drawn)
        accepted = children >= 0
        lengths[requests[~accepted]] = level + 1
        requests, nodes = requests[accepted], children[accepted]
        level += 1
    return emitted, paths, lengths
