# SPDX-License-Identifier: Apache-2.0
"""Engine-independent ESP: pure functions on tensors, no vLLM import.

* ``tree``: tree shapes (``TreeSpec``) and the verification block layout
  (``BlockLayout``: row order, positions, tree attention mask), cached per shape.
* ``proposal``: the next draft tree from the mask rows' logits (static top-1
  expansion, dynamic best-first, the first-step placeholder).
* ``mask_embedding``: the soft mask embedding's initialisation and EMA.
* ``verify``: lossless greedy and sampling verification of a tree.
* ``sources``: candidate sources behind one interface (ESP masks, prompt lookup).

``vllm_esp.reference`` runs all of it on Hugging Face transformers; the vLLM
adapter runs the same functions inside vLLM's model runner.
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
from vllm_esp.core.sources import (
                                          CandidateSource,
                                          ESPMaskSource,
                                          PromptLookupSource,
                                          ProposalContext,
)
from vllm_esp.core.tree import (
                                          BlockLayout,
                                          TreeSpec,
                                          block_complexity,
                                          block_layout,
                                          chain_tree,
                                          static_tree,
)
from vllm_esp.core.verify import (
                                          VerifyResult,
                                          chain_rejection_sample,
                                          chain_verify_sampling,
                                          greedy_verify,
                                          sample_and_match,
                                          select_chain,
)

__all__ = [
    "BlockLayout", "CandidateSource", "DraftTree", "ESPMaskSource",
    "MaskEmbeddingState", "PromptLookupSource", "ProposalContext", "TreeSpec",
    "VerifyResult", "block_complexity", "block_layout", "chain_rejection_sample",
    "chain_tree", "chain_verify_sampling", "dynamic_next_tree", "ema_update",
    "ema_update_packed", "embedding_table_stats", "greedy_verify",
    "initial_mask_embedding", "next_tree", "placeholder_tree",
    "sample_and_match", "select_chain", "static_next_tree", "static_tree",
]
