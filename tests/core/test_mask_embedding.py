# SPDX-License-Identifier: Apache-2.0
"""Mask embedding initialisation and EMA."""

from __future__ import annotations

import pytest
import torch

from vllm_esp.core.mask_embedding import (
    MaskEmbeddingState,
    ema_update,
    ema_update_packed,
    embedding_table_stats,
    initial_mask_embedding,
)


def _sequential(m, embeddings, ema):
    m = m.double().clone()
    for e in embeddings.double():
        m = m + ema * (e - m)
    return m


def test_worked_example():
    m = initial_mask_embedding(torch.tensor([[0.0, 0.0], [2.0, 4.0]]))
    assert m.tolist() == [1.0, 2.0]
    m = ema_update(m, torch.tensor([[3.0, 2.0]]), 0.5)
    assert m.tolist() == [2.0, 2.0]
    m = ema_update(m, torch.tensor([[0.0, 4.0]]), 0.5)
    assert m.tolist() == [1.0, 3.0]


@pytest.mark.parametrize("ema", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_ema_closed_form_matches_sequential(ema, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    m = torch.randn(16, generator=g)
    embeddings = torch.randn(num_tokens, 16, generator=g).to(torch.bfloat16)
    out = ema_update(m, embeddings, ema)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _sequential(m, embeddings, ema),
                               atol=1e-5, rtol=1e-5)


def test_ema_packed_matches_per_request():
    g = torch.Generator().manual_seed(0)
    masks = torch.randn(3, 8, generator=g)
    embeddings = torch.randn(7, 8, generator=g)
    request_index = torch.tensor([2, 0, 2, 2, 0, 1, 2])  # interleaved, commit order per request
    out = ema_update_packed(masks, embeddings, request_index, 0.1)
    for r in range(3):
        expected = _sequential(masks[r], embeddings[request_index == r], 0.1)
        torch.testing.assert_close(out[r].double(), expected, atol=1e-6, rtol=1e-6)
    # The proposer passes the request index as a numpy array.
    assert torch.equal(ema_update_packed(masks, embeddings, request_index.numpy(), 0.1), out)
    # A request without tokens is unchanged.
    out = ema_update_packed(masks, embeddings[:2], torch.tensor([0, 0]), 0.1)
    assert torch.equal(out[1:], masks[1:])


def test_state_commits_in_order():
    state = MaskEmbeddingState(torch.zeros(2), ema=0.5)
    state.commit(torch.tensor([[4.0, 0.0]]))
    state.commit(torch.tensor([[0.0, 4.0], [2.0, 2.0]]))
    assert state.mask_embedding.tolist() == [1.5, 2.0]


def test_init_modes():
    prompt = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.bfloat16)
    assert initial_mask_embedding(prompt, "mean").dtype == torch.float32
    assert initial_mask_embedding(prompt, "last").tolist() == [3.0, 6.0]
    assert initial_mask_embedding(prompt, "zero").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        initial_mask_embedding(prompt, "sample")
    with pytest.raises(ValueError):
        initial_mask_embedding(prompt, "bogus")


def test_sample_init_fits_scaled_table():
    g = torch.Generator().manual_seed(0)
    hidden = 256
    table = torch.randn(4000, hidden, generator=g) * 0.5 + 2.0
    mu, sigma = embedding_table_stats(table, embedding_scale=3.0)
    torch.testing.assert_close(mu, torch.full((hidden,), 6.0), atol=0.12, rtol=0)
    assert abs(float(sigma) - 1.5) < 0.02
    draws = torch.stack([
        initial_mask_embedding(torch.zeros(1, hidden), "sample", table,
                               torch.Generator().manual_seed(s), embedding_scale=3.0)
        for s in range(10)])
    # 2560 draws of N(6, 1.5^2): 4-sigma bounds on mean and std.
    assert abs(float(draws.mean()) - 6.0) < 4 * 1.5 / 2560 ** 0.5
    assert abs(float(draws.std()) - 1.5) < 4 * 1.5 / (2 * 2560) ** 0.5
    same = initial_mask_embedding(torch.zeros(1, hidden), "sample", table,
                                  torch.Generator().manual_seed(0), embedding_scale=3.0)
    assert torch.equal(same, draws[0])  # reproducible with a seeded generator
