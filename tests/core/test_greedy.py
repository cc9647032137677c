# SPDX-License-Identifier: Apache-2.0
"""Greedy chain verification from the rows' argmax (core.greedy): the
argmax as torch takes it, and acceptance as vLLM's greedy rejection kernel
accepts (tests/test_argmax_verification.py checks it against vLLM's
RejectionSampler itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_esp.core.greedy import PLACEHOLDER_TOKEN_ID, argmax_rows, greedy_chain_tokens


def _hard_rows(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=generator)
    logits[1, [3, vocab - 1]] = 50.0          # a tie: the first index wins
    logits[2, :] = 1.5                        # a constant row
    logits[3, :] = float("-inf")
    logits[3, vocab // 2] = -1e30
    logits[4, 9] = float("nan")               # NaN counts as the maximum
    logits[5, [4, 11]] = float("nan")
    logits[6, :] = float("-inf")              # all -inf: index 0
    return logits


@pytest.mark.parametrize("vocab", [49152, 1001])
def test_argmax_rows_is_torch_argmax(vocab):
    logits = _hard_rows(vocab)
    expected = logits.argmax(dim=-1).numpy()
    assert expected[1] == 3 and expected[2] == 0 and expected[4] == 9
    np.testing.assert_array_equal(argmax_rows(logits), expected)
    # A strided view (every other row) and bf16 (widened exactly).
    np.testing.assert_array_equal(argmax_rows(logits[::2]), expected[::2])
    half = logits.to(torch.bfloat16)
    np.testing.assert_array_equal(argmax_rows(half), half.argmax(dim=-1).numpy())


def _reference(row_tokens, draft_tokens, num_drafts):
    """vLLM's rejection_greedy_sample_kernel, one request at a time."""
    width = max(num_drafts, default=0) + 1
    out = np.full((len(num_drafts), width), PLACEHOLDER_TOKEN_ID, np.int32)
    row = draft = 0
    for request, n in enumerate(num_drafts):
        rejected = False
        for position in range(n):
            token = row_tokens[row + position]
            out[request, position] = token
            if draft_tokens[draft + position] != token:
                rejected = True
                break
        if not rejected:
            out[request, n] = row_tokens[row + n]
        row += n + 1
        draft += n
    return out


def test_the_docstring_example():
    out = greedy_chain_tokens(np.array([7, 9, 2, 4, 6]), np.array([7, 8, 4]), np.array([2, 1]))
    assert out.tolist() == [[7, 9, -1], [4, 6, -1]]
    assert out.dtype == np.int32


def test_greedy_chain_tokens_accept_as_vllms_kernel():
    rng = np.random.default_rng(3)
    for _ in range(300):
        num_drafts = rng.integers(0, 6, size=rng.integers(1, 9))
        rows = int((num_drafts + 1).sum())
        # A small vocabulary, so that drafts often match.
        row_tokens = rng.integers(0, 3, size=rows)
        drafts = np.concatenate([
            np.where(rng.random(n) < 0.7, row_tokens[start:start + n], rng.integers(0, 3, n))
            for start, n in zip(np.cumsum(num_drafts + 1) - num_drafts - 1, num_drafts)]
            + [np.zeros(0, np.int64)])
        np.testing.assert_array_equal(
            greedy_chain_tokens(row_tokens, drafts, num_drafts),
            _reference(row_tokens.tolist(), drafts.tolist(), num_drafts.tolist()))


def test_no_drafts_emit_the_bonus_alone():
    out = greedy_chain_tokens(np.array([5, 8]), np.zeros(0, np.int64), np.array([0, 0]))
    assert out.tolist() == [[5], [8]]
