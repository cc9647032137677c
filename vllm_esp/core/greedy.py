# SPDX-License-Identifier: Apache-2.0
"""Greedy verification of chains from the argmax of their logits rows.

When every request of a step decodes greedily and nothing else touches the
logits (no penalties, bad words, allowed token ids, active logits
processors or logprobs: ``vllm_esp.sampling.argmax_decides``), vLLM's
``RejectionSampler`` reduces to "the argmax of each row, accepted while it
equals the draft". It gets there by copying the verified rows twice (the
bonus rows' sampler keeps a copy of their logits for logprobs even when
none are asked for; the target rows are gathered and cloned) and taking
``torch.argmax``, which on CPU does not vectorise (what that costs:
docs/results.md, "Host time per step"). NumPy's argmax is vectorised, so
this takes the argmax once, in place, and accepts with array operations.

Example: two requests verifying drafts ``[7, 8]`` and ``[4]``, their rows'
argmax ``[7, 9, 2 | 4, 6]`` (each request's ``n`` target rows and then its
bonus row): the first accepts 7, emits 9 for 8 and stops; the second
accepts 4 and emits its bonus 6::

    greedy_chain_tokens(np.array([7, 9, 2, 4, 6]), np.array([7, 8, 4]), np.array([2, 1]))
    -> [[7, 9, -1], [4, 6, -1]]
"""

from __future__ import annotations

import numpy as np
import torch

# vLLM's padding of a request's output row past its last token.
PLACEHOLDER_TOKEN_ID = -1


def argmax_rows(logits: torch.Tensor) -> np.ndarray:
    """Each row's argmax (the first index of its maximum, a NaN counting as
    the maximum, as ``torch.argmax``), as int64."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).cpu().numpy()
    if logits.dtype != torch.float32:
        # bf16/fp16 widen exactly, so the order and the ties are kept.
        logits = logits.float()
    return logits.numpy().argmax(axis=1)


def greedy_chain_tokens(row_tokens: np.ndarray, draft_tokens: np.ndarray,
                        num_drafts: np.ndarray) -> np.ndarray:
    """vLLM's greedy rejection sampling from the rows' argmax.

    Request ``r`` owns ``num_drafts[r] + 1`` consecutive entries of
    ``row_tokens`` (the argmax at each of its drafts' rows, then at its
    bonus row) and ``num_drafts[r]`` consecutive ``draft_tokens``. Its
    output row holds the argmax tokens up to and including the first that
    differs from its draft (or all of them and the bonus), padded with
    ``PLACEHOLDER_TOKEN_ID`` to ``max(num_drafts) + 1`` columns, int32."""
    num_drafts = np.asarray(num_drafts, np.int64)
    num_requests = num_drafts.shape[0]
    width = int(num_drafts.max()) + 1 if num_requests else 1
    column = np.arange(width)
    has_row = column[None, :] <= num_drafts[:, None]
    targets = np.full((num_requests, width), PLACEHOLDER_TOKEN_ID, np.int64)
    targets[has_row] = row_tokens
    # A draft never equals the padding of a position it does not have.
    drafts = np.full((num_requests, width), PLACEHOLDER_TOKEN_ID - 1, np.int64)
    drafts[column[None, :] < num_drafts[:, None]] = draft_tokens
    num_accepted = np.cumprod(drafts == targets, axis=1).sum(axis=1)
    emitted = column[None, :] <= num_accepted[:, None]
    return np.where(emitted, targets, PLACEHOLDER_TOKEN_ID).astype(np.int32)
