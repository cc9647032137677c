"""The per-step hand-off between the ESP model runner and its attention impl.

vLLM's attention layers only receive backend metadata, which has no slot for
a tree mask. The runner therefore publishes the current step's ESP blocks
here before the forward, and the attention impl reads them. The context is
process-local (every TP rank builds the same one) and is cleared when the
step's verification is done. CPU attention is an opaque custom op, so this
Python side channel runs even when the model is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    blocks: list[ESPBlock]
    # Flat rows of every tree node of every block, block after block; the
    # attention impl stashes post-RoPE K/V of these rows for relocation.
    node_rows: torch.Tensor
    # Offset of each block's nodes inside node_rows.
    node_row_offsets: list[int]
    # Filled during the forward: layer name -> (key, value) of node_rows.
    kv_stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Filled after the forward.
    hidden_states: torch.Tensor | None = None
    slot_mappings: dict[str, torch.Tensor] | None = None


_current_step: ESPStep | None = None


def set_current_step(step: ESPStep | None) -> None:
    global _current_step
    _current_step = step


def current_step() -> ESPStep | None:
    return _current_step
