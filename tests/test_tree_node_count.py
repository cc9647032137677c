"""How the ESP scheduler reads tree nodes off a scheduled draft list."""

from vllm_esp.proposer import MASK_SLOT_TOKEN, tree_node_count

M = MASK_SLOT_TOKEN


def test_full_and_smaller_blocks_count_their_nodes():
    # tree [4], k=1: 4 nodes, then 5 mask slots.
    assert tree_node_count([17, 9, 3, 88] + [M] * 5, 1) == 4
    # A hybrid tree of 2 nodes in a 10-slot budget: 2 nodes + 3 mask slots.
    assert tree_node_count([17, 9] + [M] * 3, 1) == 2
    # k=2: n nodes + 2 (n + 1) mask slots.
    assert tree_node_count([5, 6, 7] + [M] * 8, 2) == 3


def test_chains_are_counted_as_they_are():
    # A block truncated by the scheduler: its tail is not all mask slots.
    assert tree_node_count([17, 9, 3, 88, M, M, M], 1) == 7
    assert tree_node_count([17, 9, 3], 1) == 3  # odd length + 1: not a block
    # Prompt lookup alone carries no masks: every slot is a node.
    assert tree_node_count([4, 5, 6], 0) == 3
    assert tree_node_count([], 1) == 0
