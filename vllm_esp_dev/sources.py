# SPDX-License-Identifier: Apache-2.0
"""Candidate sources: where the tokens of a step's draft tree come from.

A source sees the request's history and the mask logits of the last step and
returns a ``DraftTree`` (or ``None`` for "no proposal": the step then
verifies the root alone, a plain decoding step). Two sources exist:

* ``ESPMaskSource``: ESP proper. The tree comes from the mask rows' logits
  (``next_tree``), or is the placeholder tree on the first step after prefill.
* ``PromptLookupSource``: n-gram prompt lookup (like vLLM's ngram proposer).
  Worked example, ``max_ngram=3``, ``num_draft_tokens=3``::

      history: a b c d b c e f b c
      suffix 3-gram "f b c": no earlier occurrence
      suffix 2-gram "b c":   most recent earlier occurrence at index 4
      proposal: the 3 tokens after it -> e f b  (a chain under root "c")

  The most recent occurrence is preferred because recent text is the most
  likely to be repeated (e.g. a loop, or code being edited).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.batch import hybrid_next_tree
from vllm_esp.core.hybrid import find_ngram_matches
from vllm_esp.core.proposal import DraftTree, next_tree, placeholder_tree
from vllm_esp.core.tree import chain_tree

__all__ = [
    "ProposalContext",
    "CandidateSource",
    "ESPMaskSource",
    "PromptLookupSource",
    "HybridSource",
    "candidate_source",
    "find_ngram_continuation",
]


@dataclass(frozen=True, eq=False)
class ProposalContext:
    """What a source may look at when proposing the next step's tree.

    ``token_ids``: prompt + generated tokens, ending with ``root_token`` (the
    last committed token, which is the next tree's root and not yet in the
    KV cache). ``mask_logits``: [k, V] logits of the masks of the last
    reached node, or ``None`` on the first step after prefill.
    """

    token_ids: Sequence[int] | np.ndarray | torch.Tensor
    root_token: int
    mask_logits: torch.Tensor | None = None


@runtime_checkable
class CandidateSource(Protocol):
    def propose(self, context: ProposalContext) -> DraftTree | None:
        ...


class ESPMaskSource:
    """ESP's own proposals: the next tree from the mask logits."""

    def __init__(self, config: ESPConfig) -> None:
        self.config = config

    def propose(self, context: ProposalContext) -> DraftTree:
        if context.mask_logits is None:
            return placeholder_tree(self.config, context.root_token)
        return next_tree(self.config, context.mask_logits, context.root_token)


def find_ngram_continuation(token_ids: np.ndarray, max_ngram: int, min_ngram: int,
                            max_tokens: int) -> np.ndarray:
    """Tokens that followed the most recent earlier occurrence of the longest
    matching suffix n-gram (``max_ngram`` down to ``min_ngram``); empty if none.

    The continuation is cut at the end of the history, so it can be shorter
    than ``max_tokens``.
    """
    _, starts = find_ngram_matches(token_ids, max_ngram, min_ngram)
    if starts.size == 0:
        return token_ids[:0]
    start = int(starts[-1])
    return token_ids[start:start + max_tokens]


class PromptLookupSource:
    """n-gram prompt lookup as a chain ``DraftTree``.

    ``num_mask_tokens`` lets the chain carry ESP masks (a hybrid); 0 gives
    pure prompt lookup. Returns ``None`` when nothing matches.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1,
                 num_draft_tokens: int = 10, num_mask_tokens: int = 0) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("PromptLookupSource: need 1 <= min_ngram <= max_ngram")
        if num_draft_tokens < 1:
            raise ValueError("PromptLookupSource: num_draft_tokens must be >= 1")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_draft_tokens = num_draft_tokens
        self.num_mask_tokens = num_mask_tokens

    def propose(self, context: ProposalContext) -> DraftTree | None:
        token_ids = _history(context)
        drafts = find_ngram_continuation(token_ids, self.max_ngram, self.min_ngram,
                                         self.num_draft_tokens)
        if drafts.size == 0:
            return None
        tokens = torch.from_numpy(np.concatenate([token_ids[-1:], drafts]))
        return DraftTree(chain_tree(int(drafts.size), self.num_mask_tokens), tokens)


def _history(context: ProposalContext) -> np.ndarray:
    token_ids = context.token_ids
    if torch.is_tensor(token_ids):
        token_ids = token_ids.cpu().numpy()
    token_ids = np.asarray(token_ids, dtype=np.int64)
    if token_ids.size == 0 or int(token_ids[-1]) != int(context.root_token):
        raise ValueError("ProposalContext.token_ids must end with root_token")
    return token_ids


class HybridSource:
    """ESP mask candidates and prompt-lookup candidates in one tree under the
    config's node budget (``vllm_esp.core.hybrid``)."""

    def __init__(self, config: ESPConfig) -> None:
        self.config = config

    def propose(self, context: ProposalContext) -> DraftTree | None:
        config = self.config
        tree = hybrid_next_tree(
            _history(context), context.root_token, context.mask_logits,
            block_size=config.block_size,
            num_mask_tokens=config.num_mask_tokens,
            candidates=config.candidates)
        if tree is None and "esp" in config.candidates:
            return placeholder_tree(config, context.root_token)
        return tree


def candidate_source(config: ESPConfig) -> CandidateSource:
    """The source ``config.candidates`` asks for: ESP alone, or the hybrid."""
    if tuple(config.candidates) == ("esp",):
        return ESPMaskSource(config)
    return HybridSource(config)
