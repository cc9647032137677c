# SPDX-License-Identifier: Apache-2.0
"""Engine-independent ESP: pure functions on tensors, no vLLM import.

* ``tree``: tree shapes (``TreeSpec``) and the verification block layout
  (``BlockLayout``: row order, positions, tree attention mask), cached per shape.
* ``proposal``: the next draft tree from the mask rows' logits (static top-1
  expansion, dynamic best-first, the first-step placeholder).
* ``mask_embedding``: the soft mask embedding's initialisation and EMA.
* ``batch``, ``hybrid``, ``goodput``: the batched proposal the engine runs
  (the hybrid tree, the goodput allocation, block layouts, chain selection).
* ``tree_walk``: the verification of sampled requests by walking the trees.

The per-request verification and candidate sources that the reference
decoder (``vllm_esp_dev.reference``, on Hugging Face transformers) runs
live in ``vllm_esp_dev`` (``verify``, ``sources``): the engine does not use
them.
"""

from vllm_esp.core.mask_embedding import (
                                          MaskEmbeddingState,
                                          ema_update,
                                          ema_update_packed,
                                          embedding_table_stats,
                                          initial_mask_embedding,
)
from vllm_esp.core.proposal import (
                                          DraftTree,
                                          dynamic_next_tree,
                                          next_tree,
                                          placeholder_tree,
                                          static_next_tree,
)
from vllm_esp.core.tree import (
                                          BlockLayout,
                                          TreeSpec,
                                          block_complexity,
                                          block_layout,
                                          chain_tree,
                                          static_tree,
)

__all__ = [
    "BlockLayout", "DraftTree", "MaskEmbeddingState", "TreeSpec",
    "block_complexity", "block_layout", "chain_tree", "dynamic_next_tree",
    "ema_update", "ema_update_packed", "embedding_table_stats",
    "initial_mask_embedding", "next_tree", "placeholder_tree",
    "static_next_tree", "static_tree",
]
