# SPDX-License-Identifier: Apache-2.0
"""Draft-tree shapes and the block layout ESP verifies in one forward pass.

ESP (Embedding-Space Probing, arXiv 2603.17942) verifies a small *tree* of
draft tokens in a single target forward. Behind every tree node it also
places ``k`` "mask" rows (a shared soft embedding): the logits of mask ``j``
of node ``n`` guess the token ``j + 1`` places after ``n``, which is where the
next step's tree comes from. This module turns a tree *shape* into the
flattened *block* of rows fed to the model: row order, position offsets and
the tree attention mask. Nothing here depends on token values, so a layout is
built once per shape and cached.

Worked example: ``static_tree([2, 1])`` (k = 2 masks per node)::

    tree                      parents = (-1, 0, 0, 1)    depths = (0, 1, 1, 2)
      0 (root, depth 0)
      ├── 1 (depth 1)         level 1 = 2 children of the root
      │   └── 3 (depth 2)     level 2 = 1 child of the FIRST level-1 node
      └── 2 (depth 1)

    T = 4 nodes, Q = (k + 1) * T = 12 rows. Block order:

    row:      0   1   2   3 |  4    5  |  6    7  |  8    9  | 10   11
    what:     n0  n1  n2  n3| m0.1 m0.2| m1.1 m1.2| m2.1 m2.2| m3.1 m3.2
    offset:   0   1   1   2 |  1    2  |  2    3  |  2    3  |  3    4

    (``m1.2`` = mask 2 of node 1; a node at depth d sits at p + d, its mask j
    at p + d + j, where p is the root's position.)

    Attention (row may attend column; every row also sees the whole cached
    prefix, which is not part of the layout):
      n3 sees n0, n1, n3              (root, ancestors, itself)
      m1.2 sees n0, n1, m1.1, m1.2    (what n1 sees, n1, masks 1..2 of n1)

Because nodes come in BFS order and each node's masks come after all nodes,
every row only attends to rows before it: the tree mask is a subset of the
causal mask, so a plain causal KV write order stays valid.

A layout with ``num_mask_tokens == 0`` is a plain token tree (or chain),
which is what prompt lookup proposes.

Masks need not ride on every node. ``TreeSpec(..., masked=...)`` names the
nodes that carry their ``k`` masks; the others carry none. Only the masks of
the last accepted node are ever read, so a hybrid tree (``core.hybrid``)
spends mask rows only where that node is likely to be, and the rest of the
block on draft nodes. With ``static_tree([2, 1])`` and masks on nodes 0 and
1 only, the block is ``n0 n1 n2 n3 | m0.1 m0.2 | m1.1 m1.2`` (8 rows):
mask rows keep the node order of the masked nodes, and every rule above is
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "TreeSpec",
    "BlockLayout",
    "static_tree",
    "chain_tree",
    "block_layout",
    "block_complexity",
]


@dataclass(frozen=True)
class TreeSpec:
    """The shape of a draft tree: parent pointers in BFS order, plus ``k``.

    ``parents[0] == -1`` is the root (the last committed token, not yet in the
    KV cache). ``parents[i] < i`` and depths never decrease with ``i``, so the
    node order is a BFS order and therefore topological.

    ``masked[t]`` says whether node ``t`` carries the ``k`` masks; ``None``
    (the default) means every node does, as in the paper.
    """

    parents: tuple[int, ...]
    num_mask_tokens: int
    masked: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if not parents or parents[0] != -1:
            raise ValueError(f"TreeSpec: parents[0] must be -1 (root), got {parents}")
        if not isinstance(self.num_mask_tokens, int) or self.num_mask_tokens < 0:
            raise ValueError(
                f"TreeSpec: num_mask_tokens must be an int >= 0, got "
                f"{self.num_mask_tokens!r}")
        depths = [0]
        for i, parent in enumerate(parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(
                    f"TreeSpec: node {i} has parent {parent}; parents must "
                    f"precede their children (0 <= parent < {i})")
            depths.append(depths[parent] + 1)
            if depths[i] < depths[i - 1]:
                raise ValueError(
                    f"TreeSpec: depths must be non-decreasing (BFS order); "
                    f"node {i} has depth {depths[i]} after depth {depths[i - 1]}")
        object.__setattr__(self, "_depths", tuple(depths))
        masked = self.masked
        if masked is None or self.num_mask_tokens == 0:
            masked = (self.num_mask_tokens > 0,) * len(parents)
        masked = tuple(bool(m) for m in masked)
        if len(masked) != len(parents):
            raise ValueError(
                f"TreeSpec: masked has {len(masked)} entries for "
                f"{len(parents)} nodes")
        # Normalised, so that equal shapes compare and hash equal (layouts
        # are cached per TreeSpec).
        object.__setattr__(self, "masked", masked)

    @property
    def num_nodes(self) -> int:
        """T: nodes including the root."""
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        return self._depths  # type: ignore[attr-defined]

    @property
    def max_depth(self) -> int:
        return self._depths[-1]  # type: ignore[attr-defined]

    @property
    def num_masked_nodes(self) -> int:
        """Nodes carrying masks (T unless ``masked`` says otherwise)."""
        return sum(self.masked)  # type: ignore[arg-type]

    @property
    def block_size(self) -> int:
        """Q = T + k * (masked nodes): rows of the verification block
        ((k + 1) * T when every node carries masks)."""
        return self.num_nodes + self.num_mask_tokens * self.num_masked_nodes


def static_tree(widths: Sequence[int]) -> TreeSpec:
    """The paper's "top-1 expansion" shape (Appendix D), with ``k = len(widths)``.

    Level 1 is ``widths[0]`` children of the root; level ``i >= 2`` is
    ``widths[i-1]`` children of the *first* node of level ``i - 1``. Within a
    level candidates are ordered by descending probability, so "first" means
    "most probable". ``static_tree((15, 4))`` has 1 + 15 + 4 = 20 nodes.
    """
    return _static_tree(tuple(int(w) for w in widths))


@functools.lru_cache(maxsize=64)
def _static_tree(widths: tuple[int, ...]) -> TreeSpec:
    if any(w < 1 for w in widths):
        raise ValueError(f"static_tree: widths must be positive, got {widths}")
    parents = [-1]
    first_of_previous_level = 0
    for width in widths:
        first_of_level = len(parents)
        parents.extend([first_of_previous_level] * width)
        first_of_previous_level = first_of_level
    return TreeSpec(tuple(parents), num_mask_tokens=len(widths))


@functools.lru_cache(maxsize=256)
def chain_tree(num_draft_tokens: int, num_mask_tokens: int = 0) -> TreeSpec:
    """A chain: root followed by ``num_draft_tokens`` nodes, one per level."""
    if num_draft_tokens < 0:
        raise ValueError("chain_tree: num_draft_tokens must be >= 0")
    return TreeSpec(tuple(range(-1, num_draft_tokens)), num_mask_tokens)


def block_complexity(tree_spec: TreeSpec) -> int:
    """Tokens per request per verification forward: ``(k + 1) * T``."""
    return tree_spec.block_size


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Row order, positions and attention of one verification block.

    All fields are CPU tensors (int64 or bool), shared by every caller of
    ``block_layout`` for the same shape: treat them as read-only.

    Rows ``0..T-1`` are the tree nodes (``node_rows == arange(T)``); then
    the masks of each masked node in node order: with every node masked,
    row ``T + t*k + (j-1)`` is mask ``j`` (1-based) of node ``t``.
    """

    tree_spec: TreeSpec
    num_nodes: int                 # T
    num_mask_tokens: int           # k
    block_size: int                # Q = T + k * (masked nodes)
    max_depth: int
    parents: torch.Tensor          # [T] int64, root -1
    depths: torch.Tensor           # [T] int64
    ancestors: torch.Tensor        # [T, T] bool, [t, a]: a is t or an ancestor of t
    children: torch.Tensor         # [T, C] int64, ascending, padded with -1 (C >= 1)
    num_children: torch.Tensor     # [T] int64
    node_rows: torch.Tensor        # [T] int64 (= arange(T))
    has_masks: torch.Tensor        # [T] bool, node carries masks
    mask_rows: torch.Tensor        # [T, k] int64, row of mask j of t at [t, j-1]; -1 if unmasked
    row_owner: torch.Tensor        # [Q] int64, the node each row belongs to
    is_mask_row: torch.Tensor      # [Q] bool
    mask_number: torch.Tensor      # [Q] int64, j for mask j (1-based), 0 on node rows
    position_offsets: torch.Tensor # [Q] int64, position of each row minus the root's
    attention_mask: torch.Tensor   # [Q, Q] bool, row may attend column

    def positions(self, root_position: int) -> torch.Tensor:
        """Absolute position ids of the block's rows for a root at ``root_position``."""
        return self.position_offsets + root_position


@functools.lru_cache(maxsize=256)
def block_layout(tree_spec: TreeSpec) -> BlockLayout:
    """Build (once per shape, then cached) the block layout of ``tree_spec``."""
    num_nodes = tree_spec.num_nodes
    k = tree_spec.num_mask_tokens
    block_size = tree_spec.block_size
    parents = torch.tensor(tree_spec.parents, dtype=torch.long)
    depths = torch.tensor(tree_spec.depths, dtype=torch.long)
    nodes = torch.arange(num_nodes)

    # Ancestor closure by pointer jumping one level at a time: after d rounds
    # `walker[t]` is t's ancestor d levels up (or -1 once past the root).
    ancestors = torch.eye(num_nodes, dtype=torch.bool)
    walker = nodes.clone()
    for _ in range(tree_spec.max_depth):
        walker = torch.where(walker >= 0, parents[walker.clamp(min=0)], walker)
        alive = walker >= 0
        ancestors[nodes[alive], walker[alive]] = True

    # Children lists, ascending, padded with -1. Node indices of siblings
    # follow the proposal's candidate order (most probable first).
    num_children = torch.bincount(parents[1:], minlength=num_nodes)
    width = max(1, int(num_children.max()) if num_nodes > 1 else 0)
    children = torch.full((num_nodes, width), -1, dtype=torch.long)
    if num_nodes > 1:
        child_ids = nodes[1:]
        child_parents = parents[1:]
        # Rank of each child among its siblings: children of one parent are
        # not contiguous in general (BFS), so count earlier same-parent nodes.
        same_parent = child_parents[:, None] == child_parents[None, :]
        rank = torch.tril(same_parent, diagonal=-1).sum(dim=1)
        children[child_parents, rank] = child_ids

    # Row bookkeeping: node rows first, then k masks per masked node.
    has_masks = torch.tensor(tree_spec.masked, dtype=torch.bool)
    masked_nodes = nodes[has_masks]
    mask_rows = torch.full((num_nodes, k), -1, dtype=torch.long)
    mask_rows[masked_nodes] = (num_nodes + torch.arange(masked_nodes.numel())[:, None] * k
                               + torch.arange(k)[None, :])
    row_owner = torch.cat([nodes, masked_nodes.repeat_interleave(k)])
    mask_number = torch.cat([
        torch.zeros(num_nodes, dtype=torch.long),
        torch.arange(1, k + 1).repeat(masked_nodes.numel()),
    ])
    is_mask_row = mask_number > 0
    position_offsets = depths[row_owner] + mask_number

    # Row r may attend column c when
    #   c is a node that is r's owner or one of its ancestors, or
    #   r and c are masks of the same node and c's mask number <= r's.
    # Node rows have mask_number 0, so the second clause never holds for them.
    node_column = ~is_mask_row
    sees_node = node_column[None, :] & ancestors[row_owner][:, row_owner]
    sees_mask = (is_mask_row[:, None] & is_mask_row[None, :]
                 & (row_owner[:, None] == row_owner[None, :])
                 & (mask_number[None, :] <= mask_number[:, None]))
    attention_mask = sees_node | sees_mask

    return BlockLayout(
        tree_spec=tree_spec,
        num_nodes=num_nodes,
        num_mask_tokens=k,
        block_size=block_size,
        max_depth=tree_spec.max_depth,
        parents=parents,
        depths=depths,
        ancestors=ancestors,
        children=children,
        num_children=num_children,
        node_rows=nodes,
        has_masks=has_masks,
        mask_rows=mask_rows,
        row_owner=row_owner,
        is_mask_row=is_mask_row,
        mask_number=mask_number,
        position_offsets=position_offsets,
        attention_mask=attention_mask,
    )
