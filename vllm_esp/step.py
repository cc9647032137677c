# SPDX-License-Identifier: Apache-2.0
"""One step's ESP blocks: the hand-off between the model runner, its
attention backend and the verification.

vLLM's attention layers only receive backend metadata, which has no slot for
a tree mask. The runner therefore hands the step's blocks to its own
attention metadata builders before the forward
(``ESPModelRunnerMixin._esp_publish_step``), and takes them back when the
forward is done; each builder reads the step it was given.

Everything is built once per step from arrays, for all blocks at once
(``core.batch``): the blocks' trees and layouts, their flat rows in the
step's batch, and the tensors the tree-attention kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from vllm_esp.core.batch import BlockLayouts, TreeBatch, block_layouts


@dataclass
class ESPStep:
    """The ESP blocks of one step, in batch order."""

    batch_indices: np.ndarray  # [B] rows in vLLM's input batch (ascending)
    slots: np.ndarray          # [B] the requests' ESP state slots
    trees: TreeBatch           # [B] their draft trees
    layouts: BlockLayouts      # [B] their block layouts
    row_starts: np.ndarray     # [B] flat row of each block's root
    root_positions: np.ndarray  # [B] position of each root
    # For the tree-attention kernel (int32 / bool, CPU).
    num_rows: torch.Tensor
    tree_masks: torch.Tensor
    position_offsets: torch.Tensor
    # Whether the mask rows get logits in the main pass (set with the
    # logits rows, see vllm_esp.runner.FUSED_PROBE_EXTRA_ROWS).
    fused_probe: bool = False
    # Set by the attention metadata builder when the tree-attention split
    # failed: the forward then ran plain causal attention, and only the
    # blocks' roots have valid logits (vllm_esp.containment).
    failure: Exception | None = None
    # Filled after the forward.
    hidden_states: torch.Tensor | None = None
    slot_mappings: dict[str, torch.Tensor] | None = None
    # rows() and mask_rows(), computed once.
    _rows: tuple[np.ndarray, ...] | None = None

    @classmethod
    def build(cls, batch_indices: np.ndarray, slots: np.ndarray, trees: TreeBatch,
              row_starts: np.ndarray, root_positions: np.ndarray) -> ESPStep:
        layouts = block_layouts(trees)
        return cls(
            batch_indices=batch_indices,
            slots=slots,
            trees=trees,
            layouts=layouts,
            row_starts=row_starts,
            root_positions=root_positions,
            num_rows=torch.from_numpy(layouts.num_rows),
            tree_masks=torch.from_numpy(layouts.attention_masks),
            position_offsets=torch.from_numpy(layouts.position_offsets),
        )

    @property
    def has_mask_rows(self) -> bool:
        """Whether a block has mask rows (rows fed an embedding)."""
        return bool((self.layouts.num_rows > self.trees.num_nodes).any())

    @property
    def num_blocks(self) -> int:
        return int(self.batch_indices.shape[0])

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat rows of every block row and their positions (block after block)."""
        rows, positions, _, _ = self._flat_rows()
        return rows, positions

    def mask_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat rows of every mask row and the block each belongs to."""
        _, _, mask_rows, mask_blocks = self._flat_rows()
        return mask_rows, mask_blocks

    def _flat_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._rows is None:
            num_rows = self.layouts.num_rows
            total = int(num_rows.sum())
            num_masks = total - int(self.trees.num_nodes.sum())
            self._rows = (np.empty(total, np.int64), np.empty(total, np.int64),
                          np.empty(num_masks, np.int64), np.empty(num_masks, np.int64))
            flat_rows_kernel(num_rows, self.trees.num_nodes, self.row_starts,
                             self.root_positions, self.layouts.position_offsets, *self._rows)
        return self._rows


@njit(cache=True)
def flat_rows_kernel(num_rows, num_nodes, row_starts, root_positions, position_offsets,
                     out_rows, out_positions, out_mask_rows, out_mask_blocks):
    """Every block row's flat row and position, and every mask row (a
    block's rows after its ``num_nodes`` tree nodes) with its block."""
    row = mask = 0
    for block in range(num_rows.shape[0]):
        for within in range(num_rows[block]):
            out_rows[row] = row_starts[block] + within
            out_positions[row] = root_positions[block] + position_offsets[block, within]
            row += 1
            if within >= num_nodes[block]:
                out_mask_rows[mask] = row_starts[block] + within
                out_mask_blocks[mask] = block
                mask += 1
