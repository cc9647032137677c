# SPDX-License-Identifier: Apache-2.0
"""Building the next draft tree from the mask rows' logits.

After verification, the ``k`` mask rows of the last reached node ``n_a`` hold
the next tree's candidates: mask 1 of ``n_a`` sits at the bonus token's
position, so its logits guess the first token *after* the bonus (the next
root); mask ``i`` guesses level ``i`` of the next tree.

Worked example (static tree, widths ``[3, 2]``, root token 7)::

    mask 1 top-4: 7 (0.40), 12 (0.30), 5 (0.20), 9 (0.05)
    mask 2 top-3: 12 (0.50), 3 (0.30), 8 (0.10)

    level 1: top-3 of mask 1 without the parent's token 7  -> 12, 5, 9
    level 2: top-2 of mask 2 under node 1 (token 12, the most probable of
             level 1), without 12                         -> 3, 8

    tokens  = [7, 12, 5, 9, 3, 8]
    parents = [-1, 0, 0, 0, 1, 1]

Dropping the parent's token (paper Sec. 3.5) matters because mask 1's top-1
is very often an echo of its own position's token, i.e. the bonus token.

The dynamic tree (paper Algorithm 1) grows a best-first tree under a node
budget ``B`` by cumulative probability instead of fixed widths; see
``dynamic_next_tree``.

Everything is computed from a request's *candidate table*: the top ``W``
tokens of each mask and their log-probabilities (``mask_candidates``, one
``topk`` for a whole batch). The algorithms themselves are compiled
(numba) functions of one request's arrays, so that a whole batch is one
call (``vllm_esp.core.batch``); the functions here wrap them for one
request, which is what the reference decoder and the tests use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from vllm_esp.config import ESPConfig
from vllm_esp.core.tree import BlockLayout, TreeSpec, block_layout, static_tree

__all__ = [
    "DraftTree",
    "ScoredCandidates",
    "mask_candidates",
    "esp_candidates",
    "select_tree",
    "tree_from_candidates",
    "static_next_tree",
    "dynamic_next_tree",
    "placeholder_tree",
    "next_tree",
]


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A tree shape plus one token per node; ``tokens[0]`` is the root token."""

    tree_spec: TreeSpec
    tokens: torch.Tensor  # [T] int64, CPU

    def __post_init__(self) -> None:
        tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        object.__setattr__(self, "tokens", tokens)
        if tokens.numel() != self.tree_spec.num_nodes:
            raise ValueError(
                f"DraftTree: {tokens.numel()} tokens for a tree of "
                f"{self.tree_spec.num_nodes} nodes")

    @property
    def layout(self) -> BlockLayout:
        return block_layout(self.tree_spec)

    @property
    def num_nodes(self) -> int:
        return self.tree_spec.num_nodes

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @property
    def draft_tokens(self) -> torch.Tensor:
        """Tokens of the non-root nodes, in node order."""
        return self.tokens[1:]


def _check_mask_logits(mask_logits: torch.Tensor, num_levels: int) -> None:
    if mask_logits.dim() != 2 or mask_logits.shape[0] < num_levels:
        raise ValueError(
            f"mask_logits must be [k, V] with k >= {num_levels}, got "
            f"{tuple(mask_logits.shape)}")


def mask_candidates(mask_logits: torch.Tensor, width: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Candidate tables ``(tokens, log_probs)``, each ``[..., k, W]``: the
    top ``W = min(width, V)`` tokens of every mask's distribution in
    descending order, with their log-probabilities (fp32). Works on one
    request's ``[k, V]`` or a batch's ``[B, k, V]`` in one ``topk``."""
    width = min(int(width), mask_logits.shape[-1])
    log_probs = torch.log_softmax(mask_logits.float(), dim=-1).clamp(max=0.0)
    values, tokens = torch.topk(log_probs, width, dim=-1)
    return tokens.cpu().numpy().astype(np.int64), values.cpu().numpy()


@dataclass(frozen=True, eq=False)
class ScoredCandidates:
    """Candidate nodes with scores, before the budgeted selection.

    Index 0 is the root (parent -1, score 0). ``scores`` are log-estimates of
    the probability that the path to the node is accepted; a child's score
    never exceeds its parent's, which is what makes a top-``B`` selection
    ancestor-closed. Nodes are in creation order, parents before children.
    """

    parents: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64
    scores: torch.Tensor  # [N] float32
    depths: torch.Tensor  # [N] int64

    @property
    def num_candidates(self) -> int:
        return int(self.parents.numel())

    @classmethod
    def from_arrays(cls, parents, tokens, scores, depths, count) -> ScoredCandidates:
        return cls(torch.from_numpy(parents[:count].copy()),
                   torch.from_numpy(tokens[:count].copy()),
                   torch.from_numpy(scores[:count].copy()),
                   torch.from_numpy(depths[:count].copy()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (self.parents.numpy().astype(np.int64), self.tokens.numpy().astype(np.int64),
                self.scores.numpy().astype(np.float32), self.depths.numpy().astype(np.int64))


# ----------------------------------------------------------- compiled core
# Each function works on one request's arrays and writes into preallocated
# outputs; vllm_esp.core.batch loops them over a batch in compiled code.

@njit(cache=True)
def esp_candidates_kernel(cand_tokens, cand_log_probs, node_budget, root_token,
                          vocab_size, parents, tokens, scores, depths):
    """Paper Algorithm 1's candidates into ``parents/tokens/scores/depths``
    (capacity ``1 + k * node_budget``); returns how many. Level ``i``: every
    frontier node gets its ``W_i = B - i + 1`` best children from mask ``i``
    (its own token dropped), and the ``W_i`` best of all of them, stable in
    (parent, candidate) order on ties, form the next frontier."""
    num_levels = cand_tokens.shape[0]
    parents[0] = -1
    tokens[0] = root_token
    scores[0] = 0.0
    depths[0] = 0
    count = 1
    frontier_start = 0
    frontier_size = 1
    for level in range(1, num_levels + 1):
        width = min(node_budget - level + 1, vocab_size - 1)
        if width <= 0:
            break
        total = frontier_size * width
        child_parents = np.empty(total, np.int64)
        child_tokens = np.empty(total, np.int64)
        child_scores = np.empty(total, np.float32)
        filled = 0
        for f in range(frontier_size):
            node = frontier_start + f
            # Drop the parent's token from the top width + 1, or the last one.
            drop = width
            for c in range(width + 1):
                if cand_tokens[level - 1, c] == tokens[node]:
                    drop = c
                    break
            for c in range(width + 1):
                if c == drop:
                    continue
                child_parents[filled] = node
                child_tokens[filled] = cand_tokens[level - 1, c]
                child_scores[filled] = scores[node] + cand_log_probs[level - 1, c]
                filled += 1
        order = np.argsort(-child_scores, kind="mergesort")
        frontier_start = count
        for j in range(width):
            best = order[j]
            parents[count] = child_parents[best]
            tokens[count] = child_tokens[best]
            scores[count] = child_scores[best]
            depths[count] = level
            count += 1
        frontier_size = width
    return count


@njit(cache=True)
def select_kernel(scores, depths, count, node_budget, kept):
    """Root plus the ``node_budget`` best candidates into ``kept``, best
    first (score descending, then smaller depth, then creation order);
    returns how many."""
    candidates = np.arange(1, count)
    by_depth = candidates[np.argsort(depths[1:count], kind="mergesort")]
    by_score = by_depth[np.argsort(-scores[by_depth], kind="mergesort")]
    size = min(node_budget, count - 1)
    kept[0] = 0
    for i in range(size):
        kept[i + 1] = by_score[i]
    return size + 1


@njit(cache=True)
def bfs_tree_kernel(parents, tokens, depths, masked, kept, num_kept,
                    out_parents, out_tokens, out_masked):
    """The tree of the ``kept`` candidates (root first; ancestor-closed) in
    BFS order: by depth, then by their order in ``kept``. Writes parents
    (renumbered), tokens and mask flags; returns the node count, or -1 if
    ``kept`` is not ancestor-closed."""
    new_id = np.full(parents.shape[0], -1, np.int64)
    for i in range(num_kept):
        new_id[kept[i]] = -2  # kept, not yet numbered
    if kept[0] != 0:
        return -1
    for i in range(1, num_kept):
        if new_id[parents[kept[i]]] == -1:
            return -1
    order = kept[:num_kept][np.argsort(depths[kept[:num_kept]], kind="mergesort")]
    for i in range(num_kept):
        new_id[order[i]] = i
    for i in range(num_kept):
        node = order[i]
        out_parents[i] = -1 if i == 0 else new_id[parents[node]]
        out_tokens[i] = tokens[node]
        out_masked[i] = masked[node]
    return num_kept


@njit(cache=True)
def static_tree_kernel(cand_tokens, widths, root_token, vocab_size, out_parents,
                       out_tokens):
    """Top-1 expansion (paper App. D) with parent-repeat pruning: level
    ``i`` = the ``widths[i-1]`` best of mask ``i`` without the parent's
    token, under the first (most probable) node of level ``i - 1``."""
    out_parents[0] = -1
    out_tokens[0] = root_token
    count = 1
    parent = 0
    for level in range(widths.shape[0]):
        width = min(widths[level], vocab_size - 1)
        drop = width
        for c in range(width + 1):
            if cand_tokens[level, c] == out_tokens[parent]:
                drop = c
                break
        first = count
        for c in range(width + 1):
            if c == drop:
                continue
            out_parents[count] = parent
            out_tokens[count] = cand_tokens[level, c]
            count += 1
        parent = first
    return count


# ------------------------------------------------------------- one request
def esp_candidates(mask_logits: torch.Tensor, node_budget: int,
                   root_token: int) -> ScoredCandidates:
    """Candidates of the dynamic tree (paper Algorithm 1), before the final
    top-``B`` cut; see ``dynamic_next_tree``."""
    budget = int(node_budget)
    if budget < 1:
        raise ValueError(f"dynamic_next_tree: node_budget must be >= 1, got {budget}")
    _check_mask_logits(mask_logits, 1)
    cand_tokens, cand_log_probs = mask_candidates(mask_logits, budget + 1)
    capacity = 1 + mask_logits.shape[0] * budget
    parents = np.empty(capacity, np.int64)
    tokens = np.empty(capacity, np.int64)
    scores = np.empty(capacity, np.float32)
    depths = np.empty(capacity, np.int64)
    count = esp_candidates_kernel(cand_tokens, cand_log_probs, budget, int(root_token),
                                  mask_logits.shape[1], parents, tokens, scores, depths)
    return ScoredCandidates.from_arrays(parents, tokens, scores, depths, count)


def select_tree(candidates: ScoredCandidates, node_budget: int,
                num_mask_tokens: int) -> DraftTree:
    """The root plus the ``node_budget`` best candidates, as a BFS-ordered tree.

    Ties are broken towards smaller depth, then creation order, so the kept
    set stays ancestor-closed even on equal scores (a child never outscores
    its parent). Output nodes are ordered by depth, then by descending score,
    so each level's most probable node comes first.
    """
    _, _, scores, depths = candidates.arrays()
    kept = np.empty(candidates.num_candidates, np.int64)
    num_kept = select_kernel(scores, depths, candidates.num_candidates,
                             int(node_budget), kept)
    return tree_from_candidates(candidates, torch.from_numpy(kept[:num_kept]),
                                num_mask_tokens)


def tree_from_candidates(candidates: ScoredCandidates, kept: torch.Tensor,
                         num_mask_tokens: int,
                         masked: torch.Tensor | None = None) -> DraftTree:
    """The ``DraftTree`` of the candidates ``kept`` (root first, then in
    descending-score order; ancestor-closed), with masks on the candidates
    where ``masked`` (indexed by candidate; ``None``: on every node).

    Nodes are ordered by depth, then by their order in ``kept``, so each
    level's most probable node comes first.
    """
    parents, tokens, _, depths = candidates.arrays()
    kept_array = np.asarray(kept, dtype=np.int64)
    flags = (np.ones(parents.shape[0], np.bool_) if masked is None
             else np.asarray(masked, dtype=np.bool_))
    size = kept_array.shape[0]
    out_parents = np.empty(size, np.int64)
    out_tokens = np.empty(size, np.int64)
    out_masked = np.empty(size, np.bool_)
    if bfs_tree_kernel(parents, tokens, depths, flags, kept_array, size,
                       out_parents, out_tokens, out_masked) < 0:
        raise AssertionError("select_tree: kept set is not ancestor-closed")
    tree_spec = TreeSpec(tuple(out_parents.tolist()), num_mask_tokens=num_mask_tokens,
                         masked=None if masked is None else tuple(out_masked.tolist()))
    return DraftTree(tree_spec, torch.from_numpy(out_tokens))


def static_next_tree(mask_logits: torch.Tensor, widths: Sequence[int],
                     root_token: int) -> DraftTree:
    """Top-1 expansion tree (paper App. D) with parent-repeat pruning.

    Level ``i`` holds the top-``widths[i-1]`` tokens of mask ``i``, ordered by
    descending probability, as children of the root (``i == 1``) or of the
    first (most probable) node of level ``i - 1``. A candidate equal to its
    parent's token is replaced by the next-best token.
    """
    widths = tuple(int(w) for w in widths)
    _check_mask_logits(mask_logits, len(widths))
    cand_tokens, _ = mask_candidates(mask_logits[:len(widths)], max(widths) + 1)
    tree_spec = static_tree(widths)
    out_parents = np.empty(tree_spec.num_nodes, np.int64)
    out_tokens = np.empty(tree_spec.num_nodes, np.int64)
    static_tree_kernel(cand_tokens, np.asarray(widths, np.int64), int(root_token),
                       mask_logits.shape[1], out_parents, out_tokens)
    return DraftTree(tree_spec, torch.from_numpy(out_tokens))


def dynamic_next_tree(mask_logits: torch.Tensor, node_budget: int,
                      root_token: int) -> DraftTree:
    """Best-first tree under a node budget (paper Algorithm 1).

    Scores are cumulative log-probabilities, ``log P(c) = log P(parent) +
    log p_i(token)``, where ``p_i`` is mask ``i``'s distribution (the masks'
    distributions do not depend on the path, so level ``i``'s candidate
    tokens are the same under every parent, minus the parent's own token).

    Level ``i`` (1-based, ``i = 1..k``): every frontier node gets its
    ``W_i = B - i + 1`` best children from mask ``i`` (parent-repeat pruned),
    and the ``W_i`` best of all of them form the next frontier. Finally the
    ``B`` best nodes overall are kept (``select_tree``).

    Deviation note: the paper writes ``B - i``; we read its ``i`` as 0-based.
    With 1-based levels, ``B - i + 1`` is exactly what is needed for the
    result to equal the global top-``B`` of the unbounded tree: a level-``i``
    node in the top ``B`` has ``i - 1`` ancestors there too, so at most
    ``B - i + 1`` level-``i`` nodes can be in it. With ``B - i`` a ``k = 1``
    tree could never reach ``B`` nodes.

    The kept set is ancestor-closed: a child's score never exceeds its
    parent's (log-probabilities are <= 0 and float addition of a non-positive
    number is monotone), and ties are broken towards smaller depth. The tree
    has exactly ``B`` draft nodes whenever ``V > B``.
    """
    candidates = esp_candidates(mask_logits, node_budget, root_token)
    return select_tree(candidates, node_budget, num_mask_tokens=mask_logits.shape[0])


def placeholder_spec(config: ESPConfig) -> TreeSpec:
    """The shape of the first tree after prefill (see ``placeholder_tree``)."""
    if config.tree is not None:
        return static_tree(config.tree)
    return TreeSpec((-1,) + (0,) * config.node_budget,
                    num_mask_tokens=config.num_mask_tokens)


def placeholder_tree(config: ESPConfig, root_token: int) -> DraftTree:
    """The first tree after prefill, when no mask logits exist yet.

    vLLM cannot append mask rows to a prefill, so the first decode step runs
    a tree of the configured shape (a star of ``node_budget`` children for
    dynamic configs) whose every token is the root token. Its node rows can
    still accept a repetition of the root token, and its mask rows produce
    the mask logits for the second step. This is the engine-independent
    convention shared by the reference decoder and the vLLM adapter, so that
    their step counts agree. (The paper instead appends ``k`` masks to the
    prefill; the reference decoder offers that as ``prefill_masks=True``.)
    """
    tree_spec = placeholder_spec(config)
    tokens = torch.full((tree_spec.num_nodes,), int(root_token), dtype=torch.long)
    return DraftTree(tree_spec, tokens)


def next_tree(config: ESPConfig, mask_logits: torch.Tensor,
              root_token: int) -> DraftTree:
    """The next tree for ``config``: static widths or a dynamic budget."""
    if config.tree is not None:
        return static_next_tree(mask_logits, config.tree, root_token)
    return dynamic_next_tree(mask_logits, config.node_budget, root_token)
