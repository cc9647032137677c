# SPDX-License-Identifier: Apache-2.0
"""The soft mask embedding: initialisation and exponential moving average.

ESP feeds one vector ``m`` (computed, never trained) into every mask row of
a request (all masks of all nodes share it; they differ only by position and
attention). The paper initialises it from the prompt and then tracks the
generated text with an exponential moving average::

    init ("mean"):   m = mean_j e(x_j)          over the prompt's input embeddings
    update:          m <- m + ema * (e(x) - m)   once per committed token x, in order

Worked example (H = 2, ema = 0.5)::

    prompt embeddings [[0, 0], [2, 4]]  ->  m = [1, 2]
    commit x1 with e(x1) = [3, 2]      ->  m = [2, 2]
    commit x2 with e(x2) = [0, 4]      ->  m = [1, 3]

``e`` is the model's *embedding function*, including any scaling it applies
(Gemma multiplies the table by sqrt(hidden_size)). Everything is computed in
fp32 whatever the model dtype, so long generations do not drift.

Committing ``n`` tokens at once has a closed form, used here so that one step
is one small matrix product rather than ``n`` sequential updates::

    m_n = (1 - a)^n m_0 + sum_i a (1 - a)^(n - i) e(x_i),   i = 1..n
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "MASK_INIT_MODES",
    "initial_mask_embedding",
    "embedding_table_stats",
    "embedding_table_sums",
    "table_stats_from_sums",
    "ema_update",
    "ema_update_packed",
    "MaskEmbeddingState",
]

MASK_INIT_MODES = ("mean", "last", "sample", "zero")


def initial_mask_embedding(
    prompt_embeddings: torch.Tensor,
    mode: str = "mean",
    embedding_weight: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    embedding_scale: float = 1.0,
) -> torch.Tensor:
    """The initial mask embedding ``[H]`` (fp32) of one request.

    ``prompt_embeddings`` [L, H] are the prompt's input embeddings as the
    model's embedding function returns them (scaling included).

    Modes:
      * ``mean``: mean of the prompt embeddings (the paper's default).
      * ``last``: embedding of the last prompt token.
      * ``sample``: a draw from ``N(mu, sigma^2 I)`` fitted to the embedding
        table ``embedding_weight`` [V, H]: ``mu`` is the per-dimension mean of
        the rows, ``sigma`` one scalar standard deviation around it. Since the
        table is not what the model feeds its first layer when the embedding
        function scales it, both are multiplied by ``embedding_scale`` (e.g.
        ``sqrt(H)`` for Gemma), so the sample lives in the same space as
        ``e(x)``. Uses ``generator`` for reproducibility.
      * ``zero``: the zero vector.
    """
    if prompt_embeddings.dim() != 2:
        raise ValueError(
            f"prompt_embeddings must be [L, H], got {tuple(prompt_embeddings.shape)}")
    hidden_size = prompt_embeddings.shape[1]
    if mode == "mean":
        if prompt_embeddings.shape[0] == 0:
            raise ValueError("mask_init 'mean' needs a non-empty prompt")
        return prompt_embeddings.float().mean(dim=0)
    if mode == "last":
        if prompt_embeddings.shape[0] == 0:
            raise ValueError("mask_init 'last' needs a non-empty prompt")
        return prompt_embeddings[-1].float().clone()
    if mode == "zero":
        return torch.zeros(hidden_size, dtype=torch.float32,
                           device=prompt_embeddings.device)
    if mode == "sample":
        if embedding_weight is None:
            raise ValueError("mask_init 'sample' needs embedding_weight")
        mu, sigma = embedding_table_stats(embedding_weight, embedding_scale)
        noise = torch.randn(hidden_size, generator=generator,
                            dtype=torch.float32, device=mu.device)
        return (mu + sigma * noise).to(prompt_embeddings.device)
    raise ValueError(
        f"unknown mask_init {mode!r}; allowed: {' | '.join(MASK_INIT_MODES)}")


def embedding_table_stats(embedding_weight: torch.Tensor,
                          embedding_scale: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu [H], sigma [])`` of an isotropic Gaussian fitted to the table rows.

    Computed in fp32 chunks so a 262k-row bf16 table is never copied whole.
    Callers that draw many samples should cache the result.
    """
    total, total_sq, count = embedding_table_sums(embedding_weight)
    return table_stats_from_sums(total, total_sq, count, embedding_scale)


def embedding_table_sums(embedding_weight: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(sum of rows [H], sum of squares [], rows)`` in float64: sums of
    several slices of a table (tensor-parallel shards) add up to the
    table's."""
    vocab_size, hidden_size = embedding_weight.shape
    total = torch.zeros(hidden_size, dtype=torch.float64, device=embedding_weight.device)
    total_sq = torch.zeros((), dtype=torch.float64, device=embedding_weight.device)
    chunk = 16384
    for start in range(0, vocab_size, chunk):
        rows = embedding_weight[start:start + chunk].double()
        total += rows.sum(dim=0)
        total_sq += (rows * rows).sum()
    return total, total_sq, vocab_size


def table_stats_from_sums(total: torch.Tensor, total_sq: torch.Tensor, count: int,
                          embedding_scale: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``embedding_table_stats`` from ``embedding_table_sums``."""
    hidden_size = total.shape[0]
    mu = total / count
    # E|x - mu|^2 / H = (E|x|^2 - |mu|^2) / H for one scalar variance.
    variance = (total_sq / count - (mu * mu).sum()) / hidden_size
    sigma = variance.clamp(min=0).sqrt()
    return ((mu * embedding_scale).float(), (sigma * abs(embedding_scale)).float())


def ema_update(mask_embedding: torch.Tensor, token_embeddings: torch.Tensor,
               ema: float) -> torch.Tensor:
    """Apply ``m <- m + ema * (e(x) - m)`` for each row of ``token_embeddings``, in order.

    ``mask_embedding`` [H], ``token_embeddings`` [n, H]; returns a new fp32
    tensor (closed form, no loop over tokens).
    """
    mask_embedding = mask_embedding.float()
    num_tokens = token_embeddings.shape[0]
    if num_tokens == 0 or ema == 0.0:
        return mask_embedding.clone()
    keep = 1.0 - float(ema)
    # Token i (0-based) is followed by n - 1 - i later updates.
    exponents = torch.arange(num_tokens - 1, -1, -1, dtype=torch.float32,
                             device=token_embeddings.device)
    weights = float(ema) * torch.pow(torch.tensor(keep, device=exponents.device),
                                     exponents)
    return (keep ** num_tokens) * mask_embedding + weights @ token_embeddings.float()


def ema_update_packed(mask_embeddings: torch.Tensor,
                      token_embeddings: torch.Tensor,
                      request_index: np.ndarray | torch.Tensor,
                      ema: float) -> torch.Tensor:
    """Batched ``ema_update`` over requests whose tokens are packed together.

    ``mask_embeddings`` [R, H]; ``token_embeddings`` [N, H]; ``request_index``
    [N] integers (numpy or a tensor) gives each token's request. Tokens of
    one request must appear in commit order (they need not be contiguous).
    Returns new fp32 ``[R, H]``.
    """
    mask_embeddings = mask_embeddings.float()
    num_requests = mask_embeddings.shape[0]
    if token_embeddings.shape[0] == 0 or ema == 0.0:
        return mask_embeddings.clone()
    # The weights are a few numbers per token: numpy computes them in far
    # less time than a dozen small tensor ops (this runs every decode step).
    if isinstance(request_index, torch.Tensor):
        request_index = request_index.cpu().numpy()
    index = np.asarray(request_index, np.int64)
    keep = 1.0 - float(ema)
    counts = np.bincount(index, minlength=num_requests)
    # Index of each token within its request, in commit order.
    order = np.argsort(index, kind="stable")
    rank = np.empty_like(index)
    rank[order] = np.arange(index.shape[0]) - (np.cumsum(counts) - counts)[index[order]]
    weights = float(ema) * keep ** (counts[index] - 1 - rank)
    device = token_embeddings.device
    out = (torch.from_numpy(keep ** counts).to(device, torch.float32)[:, None]
           * mask_embeddings)
    return out.index_add_(0, torch.from_numpy(index).to(device),
                          torch.from_numpy(weights).to(device, torch.float32)[:, None]
                          * token_embeddings.float())


class MaskEmbeddingState:
    """The mask embedding of one request, updated as tokens are committed."""

    def __init__(self, mask_embedding: torch.Tensor, ema: float) -> None:
        self.mask_embedding = mask_embedding.float()
        self.ema = float(ema)

    def commit(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        """EMA-update with the embeddings [n, H] of newly committed tokens."""
        self.mask_embedding = ema_update(self.mask_embedding, token_embeddings,
                                         self.ema)
        return self.mask_embedding
