"""The per-step hand-off between the ESP model runner and its attention impl.

vLLM's attention layers only receive backend metadata, which has no slot for
a tree mask. The runner therefore publishes the current step's ESP blocks
here before the forward, and the attention impl reads them. The context is
process-local (every TP rank builds the same one) and is cleared when the
step's verification is done. CPU attention is an opaque custom op, so this
Python side channel runs even when the model is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import BlockLayout


@dataclass
class ESPBlock:
    """One request's verification block inside this step's flat batch."""

    req_id: str
    batch_index: int  # row of the request in input_batch / block_table
    row_start: int  # first flat token row of the block (the root)
    root_position: int  # p: position of the root
    draft_tree: DraftTree

    @property
    def layout(self) -> BlockLayout:
        return self.draft_tree.layout


@dataclass
class ESPStep:
    """Everything the attention impl and the sampler need about this step's
    ESP blocks, built once per step (not per layer)."""

    blocks: list[ESPBlock]
    # [B, Qmax] flat token rows of each block (padded with the block's first
    # row), [B, Qmax] which of them are real, [B] root positions,
    # [B, Qmax, Qmax] tree masks and [B, Qmax] position offsets (padded).
    query_rows: torch.Tensor
    query_valid: torch.Tensor
    root_positions: torch.Tensor
    tree_masks: torch.Tensor
    position_offsets: torch.Tensor
    # Flat rows of every mask token, and the block each belongs to.
    mask_rows: torch.Tensor
    mask_row_blocks: torch.Tensor
    # Flat rows of every tree node of every block, block after block.
    node_rows: torch.Tensor
    # Offset of each block's nodes inside node_rows.
    node_row_offsets: list[int]
    # For the tree-attention kernel: batch index of each block (ascending,
    # int64) and its rows Q (int32).
    batch_indices: torch.Tensor
    num_rows: torch.Tensor
    # Filled after the forward.
    hidden_states: torch.Tensor | None = None
    slot_mappings: dict[str, torch.Tensor] | None = None

    @classmethod
    def build(cls, blocks: list[ESPBlock]) -> "ESPStep":
        num_blocks = len(blocks)
        max_rows = max(block.layout.block_size for block in blocks)
        query_rows = torch.zeros(num_blocks, max_rows, dtype=torch.long)
        query_valid = torch.zeros(num_blocks, max_rows, dtype=torch.bool)
        tree_masks = torch.zeros(num_blocks, max_rows, max_rows, dtype=torch.bool)
        position_offsets = torch.zeros(num_blocks, max_rows, dtype=torch.long)
        node_rows, mask_rows, mask_row_blocks = [], [], []
        for index, block in enumerate(blocks):
            layout = block.layout
            size = layout.block_size
            query_rows[index] = block.row_start
            query_rows[index, :size] += torch.arange(size)
            query_valid[index, :size] = True
            tree_masks[index, :size, :size] = layout.attention_mask
            # Padding rows attend to themselves only, so softmax stays finite.
            tree_masks[index, size:, size:] = torch.eye(max_rows - size, dtype=torch.bool)
            position_offsets[index, :size] = layout.position_offsets
            node_rows.append(block.row_start + layout.node_rows)
            block_mask_rows = block.row_start + layout.mask_rows[layout.has_masks].reshape(-1)
            mask_rows.append(block_mask_rows)
            mask_row_blocks.append(torch.full_like(block_mask_rows, index))
        offsets = [0]
        for block in blocks[:-1]:
            offsets.append(offsets[-1] + block.layout.num_nodes)
        return cls(
            blocks=blocks,
            query_rows=query_rows,
            query_valid=query_valid,
            root_positions=torch.tensor([b.root_position for b in blocks]),
            tree_masks=tree_masks,
            position_offsets=position_offsets.to(torch.int32),
            mask_rows=torch.cat(mask_rows),
            mask_row_blocks=torch.cat(mask_row_blocks),
            node_rows=torch.cat(node_rows),
            node_row_offsets=offsets,
            batch_indices=torch.tensor([b.batch_index for b in blocks]),
            num_rows=torch.tensor([b.layout.block_size for b in blocks], dtype=torch.int32),
        )


_current_step: ESPStep | None = None


def set_current_step(step: ESPStep | None) -> None:
    global _current_step
    _current_step = step


def current_step() -> ESPStep | None:
    return _current_step
