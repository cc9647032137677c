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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.tree import (BlockLayout, TreeSpec, block_layout,
                                static_tree)

__all__ = [
    "DraftTree",
    "ScoredCandidates",
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


def _top_without(scores: torch.Tensor, count: int,
                 excluded_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``count`` (values, tokens) of ``scores`` [V], skipping ``excluded_token``.

    Takes the top ``count + 1`` and drops the excluded token if it is among
    them (otherwise the last one), so the result keeps descending order.
    """
    count = min(count, scores.numel() - 1)
    values, tokens = torch.topk(scores, count + 1)
    keep = tokens != excluded_token
    if bool(keep.all()):
        keep[-1] = False
    return values[keep], tokens[keep]


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
    tree_spec = static_tree(widths)
    tokens = [torch.tensor([root_token], dtype=torch.long)]
    parent_token = int(root_token)
    for level, width in enumerate(widths):  # k <= 3 levels
        _, level_tokens = _top_without(mask_logits[level].float(), width,
                                       parent_token)
        tokens.append(level_tokens.cpu())
        parent_token = int(level_tokens[0])
    return DraftTree(tree_spec, torch.cat(tokens))


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


def esp_candidates(mask_logits: torch.Tensor, node_budget: int,
                   root_token: int) -> ScoredCandidates:
    """Candidates of the dynamic tree (paper Algorithm 1), before the final
    top-``B`` cut; see ``dynamic_next_tree``."""
    budget = int(node_budget)
    if budget < 1:
        raise ValueError(f"dynamic_next_tree: node_budget must be >= 1, got {budget}")
    _check_mask_logits(mask_logits, 1)
    num_levels = mask_logits.shape[0]
    # Stays on the logits' device; only the per-level top-(W+1) moves to CPU.
    log_probs = torch.log_softmax(mask_logits.float(), dim=-1).clamp(max=0.0)
    vocab_size = log_probs.shape[1]

    # Frontier of the previous level, as (node id, token, score) tensors.
    # Node ids are provisional (creation order); the root is id 0.
    frontier_ids = torch.zeros(1, dtype=torch.long)
    frontier_tokens = torch.tensor([root_token], dtype=torch.long)
    frontier_scores = torch.zeros(1)
    all_parents = [torch.tensor([-1])]
    all_tokens = [frontier_tokens]
    all_scores = [frontier_scores]
    all_depths = [torch.zeros(1, dtype=torch.long)]
    num_created = 1
    for level in range(1, num_levels + 1):  # k <= 3 levels
        width = min(budget - level + 1, vocab_size - 1)
        if width <= 0:
            break
        # One candidate list per level, filtered per parent: take width + 1
        # tokens and drop the parent's token, or the last one if absent.
        cand_scores, cand_tokens = (
            t.cpu() for t in torch.topk(log_probs[level - 1], width + 1))
        is_parent = cand_tokens[None, :] == frontier_tokens[:, None]
        is_parent[~is_parent.any(dim=1), -1] = True
        keep = ~is_parent  # exactly `width` per row
        child_tokens = cand_tokens.expand_as(keep)[keep].view(-1, width)
        child_scores = (frontier_scores[:, None] + cand_scores[None, :]
                        ).masked_select(keep).view(-1, width)
        child_parents = frontier_ids[:, None].expand(-1, width)
        # Next frontier: the `width` best children across all parents.
        # Stable sort keeps parent order (more probable parent first) on ties.
        order = torch.sort(child_scores.reshape(-1), descending=True,
                           stable=True).indices[:width]
        frontier_tokens = child_tokens.reshape(-1)[order]
        frontier_scores = child_scores.reshape(-1)[order]
        parents = child_parents.reshape(-1)[order]
        frontier_ids = torch.arange(num_created, num_created + order.numel())
        num_created += order.numel()
        all_parents.append(parents)
        all_tokens.append(frontier_tokens)
        all_scores.append(frontier_scores)
        all_depths.append(torch.full_like(parents, level))
    return ScoredCandidates(torch.cat(all_parents), torch.cat(all_tokens),
                            torch.cat(all_scores), torch.cat(all_depths))


def select_tree(candidates: ScoredCandidates, node_budget: int,
                num_mask_tokens: int) -> DraftTree:
    """The root plus the ``node_budget`` best candidates, as a BFS-ordered tree.

    Ties are broken towards smaller depth, then creation order, so the kept
    set stays ancestor-closed even on equal scores (a child never outscores
    its parent). Output nodes are ordered by depth, then by descending score,
    so each level's most probable node comes first.
    """
    scores, depths = candidates.scores, candidates.depths
    # Score descending, then depth ascending: sort by depth first (stable),
    # then stably by score.
    by_depth = torch.sort(depths[1:], stable=True).indices + 1
    order = by_depth[torch.sort(scores[by_depth], descending=True,
                                stable=True).indices]
    kept = torch.cat([torch.zeros(1, dtype=torch.long), order[:int(node_budget)]])
    return tree_from_candidates(candidates, kept, num_mask_tokens)


def tree_from_candidates(candidates: ScoredCandidates, kept: torch.Tensor,
                         num_mask_tokens: int,
                         masked: torch.Tensor | None = None) -> DraftTree:
    """The ``DraftTree`` of the candidates ``kept`` (root first, then in
    descending-score order; ancestor-closed), with masks on the candidates
    where ``masked`` (indexed by candidate; ``None``: on every node).

    Nodes are ordered by depth, then by their order in ``kept``, so each
    level's most probable node comes first.
    """
    parents, tokens, depths = candidates.parents, candidates.tokens, candidates.depths
    num_created = candidates.num_candidates
    is_kept = torch.zeros(num_created, dtype=torch.bool)
    is_kept[kept] = True
    if int(kept[0]) != 0 or not bool(is_kept[parents[kept[1:]]].all()):
        raise AssertionError("select_tree: kept set is not ancestor-closed")

    # BFS order: a stable sort of `kept` by depth.
    bfs = kept[torch.sort(depths[kept], stable=True).indices]
    new_id = torch.full((num_created,), -1, dtype=torch.long)
    new_id[bfs] = torch.arange(bfs.numel())
    new_parents = torch.where(bfs == 0, -1, new_id[parents[bfs].clamp(min=0)])
    node_masked = None if masked is None else tuple(masked[bfs].tolist())
    tree_spec = TreeSpec(tuple(new_parents.tolist()), num_mask_tokens=num_mask_tokens,
                         masked=node_masked)
    return DraftTree(tree_spec, tokens[bfs])


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
    if config.tree is not None:
        tree_spec = static_tree(config.tree)
    else:
        tree_spec = TreeSpec((-1,) + (0,) * config.node_budget,
                             num_mask_tokens=config.num_mask_tokens)
    tokens = torch.full((tree_spec.num_nodes,), int(root_token), dtype=torch.long)
    return DraftTree(tree_spec, tokens)


def next_tree(config: ESPConfig, mask_logits: torch.Tensor,
              root_token: int) -> DraftTree:
    """The next tree for ``config``: static widths or a dynamic budget."""
    if config.tree is not None:
        return static_next_tree(mask_logits, config.tree, root_token)
    return dynamic_next_tree(mask_logits, config.node_budget, root_token)
