# SPDX-License-Identifier: Apache-2.0
"""Tree shapes and block layouts on worked examples."""

from __future__ import annotations

import pytest
import torch

from vllm_esp.core.tree import TreeSpec, block_complexity, block_layout, chain_tree, static_tree

STATIC_WIDTHS = [(4,), (29,), (15, 4), (3, 2, 1)]
IRREGULAR = TreeSpec((-1, 0, 0, 1, 1, 2, 3, 3, 6), num_mask_tokens=2)
# Hybrid trees: masks only on some nodes.
PARTLY_MASKED = [
    TreeSpec((-1, 0, 0, 1, 1, 2, 3, 3, 6), 2,
             masked=(True, False, True, False, False, False, True, False, True)),
    TreeSpec((-1, 0, 1, 2, 3, 4, 5, 6, 7), 1, masked=(True,) + (False,) * 7 + (True,)),
    TreeSpec((-1, 0, 0), 1, masked=(False, False, False)),
]


def _all_specs():
    specs = [static_tree(w) for w in STATIC_WIDTHS]
    specs += [IRREGULAR, chain_tree(0), chain_tree(5), chain_tree(3, 2)]
    return specs + PARTLY_MASKED


def test_static_tree_shape_worked_example():
    spec = static_tree([2, 1])
    assert spec.parents == (-1, 0, 0, 1)
    assert spec.depths == (0, 1, 1, 2)
    assert spec.num_mask_tokens == 2 and spec.num_nodes == 4 and spec.max_depth == 2
    # Level i >= 2 hangs under the FIRST node of level i - 1.
    assert static_tree([3, 2, 1]).parents == (-1, 0, 0, 0, 1, 1, 4)
    assert static_tree([15, 4]).parents[16:] == (1, 1, 1, 1)
    assert static_tree((4,)) is static_tree([4])  # cached by shape


@pytest.mark.parametrize("widths", STATIC_WIDTHS)
def test_block_complexity_static(widths):
    spec = static_tree(widths)
    expected = (len(widths) + 1) * (1 + sum(widths))
    assert block_complexity(spec) == expected == block_layout(spec).block_size
    assert {(4,): 10, (29,): 60, (15, 4): 60, (3, 2, 1): 28}[widths] == expected


@pytest.mark.parametrize("parents", [(), (0,), (-1, 1), (-1, 0, -1), (-1, 0, 1, 0)])
def test_tree_spec_rejects_invalid(parents):
    with pytest.raises(ValueError):
        TreeSpec(parents, num_mask_tokens=1)


def test_tree_spec_rejects_negative_k():
    with pytest.raises(ValueError):
        TreeSpec((-1, 0), num_mask_tokens=-1)


def test_layout_worked_example():
    layout = block_layout(static_tree([2, 1]))
    assert layout.position_offsets.tolist() == [0, 1, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4]
    assert layout.mask_rows.tolist() == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert layout.row_owner.tolist() == [0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.mask_number.tolist() == [0, 0, 0, 0] + [1, 2] * 4
    assert layout.children.tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1]]
    assert layout.num_children.tolist() == [2, 1, 0, 0]
    def sees(row):
        return torch.nonzero(layout.attention_mask[row]).flatten().tolist()

    assert sees(3) == [0, 1, 3]           # n3: root, parent, itself
    assert sees(2) == [0, 2]
    assert sees(7) == [0, 1, 6, 7]        # mask 2 of n1: n1's view, n1, masks 1..2
    assert sees(4) == [0, 4]              # mask 1 of the root


@pytest.mark.parametrize("spec", _all_specs(), ids=str)
def test_layout_invariants(spec):
    layout = block_layout(spec)
    T, k, Q = spec.num_nodes, spec.num_mask_tokens, spec.block_size
    mask = layout.attention_mask
    assert mask.shape == (Q, Q) and mask.dtype == torch.bool
    # Subset of the causal mask (so writing K/V in row order is valid).
    assert not (mask & ~torch.ones(Q, Q, dtype=torch.bool).tril()).any()
    assert mask.diagonal().all()
    # Ancestor-closed: whatever a row sees, it also sees what that sees.
    closure = (mask.int() @ mask.int()) > 0
    assert torch.equal(closure, mask)
    # Nodes never see mask rows; rows see exactly their owner's ancestors.
    assert not mask[:T, T:].any()
    assert torch.equal(mask[:, :T], layout.ancestors[layout.row_owner])
    # Positions: depth for nodes, depth + j for mask j.
    depths = torch.tensor(spec.depths)
    assert torch.equal(layout.position_offsets[:T], depths)
    masked = torch.tensor(spec.masked, dtype=torch.bool)
    assert torch.equal(layout.has_masks, masked)
    assert (layout.mask_rows[~masked] == -1).all()
    for j in range(1, k + 1):
        rows = layout.mask_rows[masked, j - 1]
        assert torch.equal(layout.position_offsets[rows], depths[masked] + j)
        assert torch.equal(layout.row_owner[rows], torch.arange(T)[masked])
        assert (layout.mask_number[rows] == j).all()
    assert torch.equal(layout.node_rows, torch.arange(T))
    assert int(layout.is_mask_row.sum()) == int(masked.sum()) * k == Q - T
    # Mask rows are exactly rows T..Q-1, in node order.
    assert torch.equal(layout.mask_rows[masked].reshape(-1), torch.arange(T, Q))
    # Every row's visible set is a chain of distinct positions 0..offset:
    # exactly what a plain causal sequence (its own path + masks) would see.
    for row in range(Q):
        seen = layout.position_offsets[mask[row]].sort().values
        assert torch.equal(seen, torch.arange(int(layout.position_offsets[row]) + 1))
    # Children lists agree with parents.
    for node in range(T):
        kids = [c for c in layout.children[node].tolist() if c >= 0]
        assert kids == [i for i, p in enumerate(spec.parents) if p == node]


def test_partly_masked_worked_example():
    """The module docstring's example: static_tree([2, 1]), masks on 0 and 1."""
    spec = TreeSpec(static_tree([2, 1]).parents, 2, masked=(True, True, False, False))
    layout = block_layout(spec)
    assert spec.block_size == layout.block_size == 8 and spec.num_masked_nodes == 2
    assert layout.mask_rows.tolist() == [[4, 5], [6, 7], [-1, -1], [-1, -1]]
    assert layout.row_owner.tolist() == [0, 1, 2, 3, 0, 0, 1, 1]
    assert layout.position_offsets.tolist() == [0, 1, 1, 2, 1, 2, 2, 3]
    full = block_layout(static_tree([2, 1]))
    # The kept rows attend exactly as they do in the fully masked block.
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(layout.attention_mask, full.attention_mask[rows][:, rows])


def test_masked_default_and_normalisation():
    assert TreeSpec((-1, 0), 1) == TreeSpec((-1, 0), 1, masked=(True, True))
    assert TreeSpec((-1, 0), 0).masked == (False, False)
    assert TreeSpec((-1, 0), 1, masked=(1, 0)).masked == (True, False)
    with pytest.raises(ValueError, match="masked"):
        TreeSpec((-1, 0), 1, masked=(True,))


def test_layout_is_cached_per_shape():
    assert block_layout(static_tree([4])) is block_layout(static_tree((4,)))
    assert block_layout(TreeSpec((-1, 0), 1)) is block_layout(TreeSpec((-1, 0), 1))


def test_layout_without_masks():
    layout = block_layout(chain_tree(3))
    assert layout.block_size == 4 and layout.mask_rows.shape == (4, 0)
    assert torch.equal(layout.attention_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert layout.positions(10).tolist() == [10, 11, 12, 13]
