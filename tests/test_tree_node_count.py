"""How the ESP scheduler reads tree nodes off a scheduled draft list."""

import pytest
import torch

from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import TreeSpec, static_tree
from vllm_esp.proposer import mask_slot_tokens, tree_node_count


def _drafts(tree_spec: TreeSpec, first_token: int = 17) -> list[int]:
    tokens = [first_token + i for i in range(tree_spec.num_nodes)]
    tree = DraftTree(tree_spec, torch.tensor(tokens))
    return tree.draft_tokens.tolist() + mask_slot_tokens(
        tree.num_nodes - 1, tree.layout.block_size - tree.num_nodes)


@pytest.mark.parametrize("tree_spec", [
    static_tree([4]),                                        # k=1, every node masked
    static_tree([3, 1]),                                     # k=2
    TreeSpec((-1, 0), 1),                                    # one draft node
    TreeSpec((-1, 0, 0, 1, 3, 4), 1,
             masked=(True, False, False, False, False, True)),  # hybrid: 2 masked
    TreeSpec((-1, 0, 1), 2, masked=(False, False, True)),   # masks on the leaf only
    TreeSpec((-1,), 1),                                      # root and its masks
], ids=["tree4", "tree31", "one-node", "hybrid", "leaf-masks", "root-only"])
def test_whole_blocks_count_their_nodes(tree_spec):
    drafts = _drafts(tree_spec)
    assert len(drafts) == tree_spec.block_size - 1
    assert tree_node_count(drafts, tree_spec.num_mask_tokens) == tree_spec.num_nodes - 1


def test_mask_slot_ids_encode_the_node_count():
    assert mask_slot_tokens(4, 5) == [4, 4, 4, 4, 5]
    assert mask_slot_tokens(0, 1) == [1]
    assert mask_slot_tokens(3, 0) == []


def test_truncated_blocks_and_chains_count_every_slot():
    block = _drafts(static_tree([4]))  # [17, 18, 19, 20, 4, 4, 4, 4, 5]
    # The scheduler cut the block inside its mask slots: a chain of 7.
    assert tree_node_count(block[:7], 1) == 7
    assert tree_node_count(block[:4], 1) == 4  # cut at the nodes' end
    assert tree_node_count([17, 9, 8], 1) == 3
    # k=2 needs an even number of mask slots.
    assert tree_node_count([5, 6, 7, 3, 3, 4], 2) == 6
    # Prompt lookup alone carries no masks: every slot is a node.
    assert tree_node_count([4, 5, 6], 0) == 3
    assert tree_node_count([], 1) == 0
