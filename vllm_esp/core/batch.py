# SPDX-License-Identifier: Apache-2.0
"""ESP for a whole batch at once: next trees, block layouts, chain selection.

The engine adapter calls these once per step for every request, in the
style of vLLM's ``ngram_proposer.py``: a compiled (numba) loop over the
batch around the per-request algorithms of ``core.proposal`` and
``core.hybrid``, reading and writing preallocated arrays. No Python runs
per request or per node.

A batch of trees is plain data, :class:`TreeBatch`: padded ``parents``,
``tokens`` and ``masked`` per request, and ``num_nodes`` (0: no tree).
:func:`block_layouts` turns the trees of a step into everything the forward
and the verification need (rows, positions, attention masks, mask rows);
:func:`select_chains` reduces each verified tree to the chain that vLLM's
rejection sampler checks, and :func:`chain_rows` lays the chains out as the
sampler takes them.

Worked example, two requests, ESP alone with ``tree=[2]`` (k = 1)::

    request 0: root 5, mask-1 candidates 5 9 4 ...  -> tree 5 -> {9, 4}
    request 1: no candidates yet (first step)        -> placeholder 7 -> {7, 7}

    TreeBatch.parents  = [[-1, 0, 0], [-1, 0, 0]]
    TreeBatch.tokens   = [[5, 9, 4], [7, 7, 7]]
    TreeBatch.masked   = all True,  num_nodes = [3, 3]

    block_layouts -> rows [6, 6]: nodes 0..2, then the masks of nodes 0..2
                     offsets [0, 1, 1, 1, 2, 2] per block
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from vllm_esp.config import ESPConfig
from vllm_esp.core.goodput import (
    NUM_REACH_BUCKETS,
    NUM_SAMPLING_BANDS,
    NUM_SOURCES,
    REACH_EDGES,
    SOURCE_ESP,
    StepBudget,
    allocate_rows,
)
from vllm_esp.core.hybrid import (
    ESP_WEIGHT,
    LOOKUP_ACCEPT,
    LOOKUP_MAX_CHAINS,
    MASK_VALUE,
    allocate_block_kernel,
    lookup_chains_kernel,
    merge_chain_kernel,
)
from vllm_esp.core.proposal import (
    DraftTree,
    bfs_tree_kernel,
    esp_candidates_kernel,
    mask_candidates,
    select_kernel,
    static_tree_kernel,
)
from vllm_esp.core.tree import TreeSpec

__all__ = [
    "TreeBatch",
    "HybridParams",
    "TreeProposer",
    "BlockLayouts",
    "block_layouts",
    "select_chains",
    "hybrid_tree",
]

# Proposal modes.
STATIC, DYNAMIC, HYBRID = 0, 1, 2


@dataclass
class TreeBatch:
    """Padded draft trees of a batch. Row ``i`` holds ``num_nodes[i]``
    nodes in BFS order (``parents[i, 0] = -1`` is the root), or no tree when
    ``num_nodes[i] == 0``; ``masked`` says which nodes carry the ``k``
    masks."""

    parents: np.ndarray    # [B, T] int64
    tokens: np.ndarray     # [B, T] int64
    masked: np.ndarray     # [B, T] bool
    num_nodes: np.ndarray  # [B] int64
    num_mask_tokens: int
    # Hybrid proposals only: each node's estimated chance of acceptance and
    # its candidate source (core.goodput.SOURCE_*), for calibration.
    reach: np.ndarray | None = None    # [B, T] float32
    sources: np.ndarray | None = None  # [B, T] int8

    @classmethod
    def empty(cls, batch_size: int, max_nodes: int, num_mask_tokens: int) -> TreeBatch:
        return cls(np.full((batch_size, max_nodes), -1, np.int64),
                   np.zeros((batch_size, max_nodes), np.int64),
                   np.zeros((batch_size, max_nodes), np.bool_),
                   np.zeros(batch_size, np.int64), num_mask_tokens,
                   np.zeros((batch_size, max_nodes), np.float32),
                   np.zeros((batch_size, max_nodes), np.int8))

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree | None], num_mask_tokens: int
                   ) -> TreeBatch:
        width = max([1] + [t.num_nodes for t in trees if t is not None])
        batch = cls.empty(len(trees), width, num_mask_tokens)
        for i, tree in enumerate(trees):
            if tree is not None:
                batch.set(i, tree)
        return batch

    def set(self, i: int, tree: DraftTree) -> None:
        size = tree.num_nodes
        self.parents[i, :size] = tree.tree_spec.parents
        self.tokens[i, :size] = tree.tokens.numpy()
        self.masked[i, :size] = tree.tree_spec.masked
        self.num_nodes[i] = size

    def set_roots(self, rows: np.ndarray, roots: np.ndarray) -> None:
        """Rows ``rows`` hold the root alone (a plain decoding step): token
        ``roots[j]`` in row ``rows[j]``, no masks, prior reach 1."""
        self.parents[rows, 0] = -1
        self.tokens[rows, 0] = roots
        self.masked[rows, 0] = False
        self.num_nodes[rows] = 1
        if self.reach is not None:
            self.reach[rows, 0] = 1.0
        if self.sources is not None:
            self.sources[rows, 0] = 0

    def tree(self, i: int) -> DraftTree | None:
        size = int(self.num_nodes[i])
        if size == 0:
            return None
        masked = tuple(self.masked[i, :size].tolist())
        spec = TreeSpec(tuple(self.parents[i, :size].tolist()), self.num_mask_tokens,
                        masked=None if all(masked) else masked)
        return DraftTree(spec, torch.from_numpy(self.tokens[i, :size].copy()))

    def block_sizes(self) -> np.ndarray:
        """Q per request: nodes plus k rows per masked node (0: no tree)."""
        masked_nodes = (self.masked & (np.arange(self.masked.shape[1]) <
                                       self.num_nodes[:, None])).sum(axis=1)
        return self.num_nodes + self.num_mask_tokens * masked_nodes


# ------------------------------------------------------------------ hybrid
@dataclass(frozen=True)
class HybridParams:
    """The hybrid's settings (see ``core.hybrid``)."""

    block_size: int
    num_mask_tokens: int
    use_esp: bool
    use_lookup: bool
    esp_log_weight: float
    lookup_accept: np.ndarray
    mask_value: float
    max_chains: int

    @property
    def node_budget(self) -> int:
        return self.block_size - 1

    @property
    def capacity(self) -> int:
        """Candidates one request can have: the root, ESP's levels, the chains."""
        budget = self.node_budget
        return 1 + self.num_mask_tokens * budget + self.max_chains * budget

    @classmethod
    def make(cls, block_size: int, num_mask_tokens: int, candidates: Sequence[str],
             esp_weight: float = ESP_WEIGHT,
             lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
             mask_value: float = MASK_VALUE) -> HybridParams:
        use_esp = "esp" in candidates
        return cls(int(block_size), int(num_mask_tokens) if use_esp else 0, use_esp,
                   "ngram" in candidates, math.log(esp_weight),
                   np.asarray(lookup_accept, np.float64), float(mask_value),
                   LOOKUP_MAX_CHAINS)


@njit(cache=True)
def log_scale(log_scales, source, log_prior):
    """The calibration of a node whose prior estimated reach is
    ``exp(log_prior)`` (``core.goodput``'s cells), in log space."""
    return log_scales[source, np.searchsorted(REACH_EDGES, math.exp(log_prior),
                                              side="right")]


@njit(cache=True)
def hybrid_tree_kernel(history, corpus_size, root_token, has_candidates, cand_tokens,
                       cand_log_probs,
                       vocab_size, block_size, num_mask_tokens, use_esp, use_lookup,
                       esp_log_weight, log_scales, lookup_accept, mask_value,
                       max_chains, capacity, root_alone, out_parents, out_tokens,
                       out_masked, out_gains, out_reach, out_sources):
    """One request's hybrid tree (``core.hybrid``); returns its node count,
    0 when no source has a candidate (unless ``root_alone``: then the root
    alone, whose masks the allocation may still choose).

    Also writes each row's gain in allocation order (``out_gains``, ``rows
    - 1`` entries, see ``core.goodput``) and each node's source tag and
    prior estimated reach (``out_sources``, ``out_reach``, BFS order).
    ``log_scales[source, reach bucket]``: the calibration, in log space; it
    shapes the tree, and ``out_reach`` leaves it out so that the
    calibration is measured against the priors."""
    budget = max(block_size - 1, 0)
    parents = np.empty(capacity, np.int64)
    tokens = np.empty(capacity, np.int64)
    scores = np.empty(capacity, np.float32)
    # Each candidate's prior log reach (its score before calibration).
    priors = np.empty(capacity, np.float32)
    depths = np.empty(capacity, np.int64)
    sources = np.zeros(capacity, np.int8)
    chain_tokens = np.empty((max_chains, budget), np.int64)
    chain_scores = np.empty((max_chains, budget), np.float32)
    chain_priors = np.empty((max_chains, budget), np.float32)
    chain_lengths = np.empty(max_chains, np.int64)
    chain_sources = np.empty(max_chains, np.int8)
    num_chains = 0
    if use_lookup and budget > 0:
        num_chains = lookup_chains_kernel(history, corpus_size, budget, max_chains,
                                          lookup_accept, chain_tokens, chain_scores,
                                          chain_lengths, chain_sources)
        for c in range(num_chains):
            for d in range(chain_lengths[c]):
                chain_priors[c, d] = chain_scores[c, d]
                chain_scores[c, d] += np.float32(
                    log_scale(log_scales, chain_sources[c], chain_priors[c, d]))
    first_chain = 0
    parents[0] = -1
    tokens[0] = root_token
    scores[0] = 0.0
    priors[0] = 0.0
    depths[0] = 0
    if use_esp and has_candidates:
        count = esp_candidates_kernel(cand_tokens, cand_log_probs, budget, root_token,
                                      vocab_size, parents, tokens, scores, depths)
        # Mask probabilities overstate acceptance.
        for i in range(1, count):
            priors[i] = scores[i] + np.float32(esp_log_weight)
            scores[i] = priors[i] + np.float32(log_scale(log_scales, SOURCE_ESP, priors[i]))
    elif num_chains > 0:
        # No mask candidates (first step after prefill, or the last accepted
        # node had no masks), or lookup alone: the first chain is the tree.
        for d in range(chain_lengths[0]):
            parents[d + 1] = d
            tokens[d + 1] = chain_tokens[0, d]
            scores[d + 1] = chain_scores[0, d]
            priors[d + 1] = chain_priors[0, d]
            depths[d + 1] = d + 1
            sources[d + 1] = chain_sources[0]
        count = chain_lengths[0] + 1
        first_chain = 1
    elif root_alone:
        count = 1
    else:
        return 0
    for c in range(first_chain, num_chains):
        count = merge_chain_kernel(parents, tokens, scores, priors, depths, count,
                                   chain_tokens[c], chain_scores[c], chain_priors[c],
                                   chain_lengths[c], sources, chain_sources[c])
    kept = np.empty(count, np.int64)
    masked = np.zeros(count, np.bool_)
    if use_esp:
        num_kept = allocate_block_kernel(parents, scores, depths, count, block_size,
                                   num_mask_tokens, mask_value, kept, masked, out_gains)
    else:
        num_kept = select_kernel(scores, depths, count, budget, kept)
        for i in range(1, num_kept):
            out_gains[i - 1] = math.exp(scores[kept[i]])
    size = bfs_tree_kernel(parents, tokens, depths, masked, kept, num_kept,
                           out_parents, out_tokens, out_masked)
    order = kept[:num_kept][np.argsort(depths[kept[:num_kept]], kind="mergesort")]
    for i in range(num_kept):
        node = order[i]
        out_sources[i] = sources[node]
        out_reach[i] = 1.0 if i == 0 else math.exp(priors[node])
    return size


def hybrid_tree(params: HybridParams, history: np.ndarray, root_token: int,
                cand_tokens: np.ndarray | None, cand_log_probs: np.ndarray | None,
                vocab_size: int | None) -> DraftTree | None:
    """One request's hybrid tree, or None (see ``core.hybrid``)."""
    has_candidates = cand_tokens is not None
    if not has_candidates:
        cand_tokens = np.zeros((1, 1), np.int64)
        cand_log_probs = np.zeros((1, 1), np.float32)
    capacity = params.capacity
    out_parents = np.empty(capacity, np.int64)
    out_tokens = np.empty(capacity, np.int64)
    out_masked = np.empty(capacity, np.bool_)
    out_gains = np.empty(max(params.block_size, 1), np.float64)
    out_reach = np.empty(capacity, np.float32)
    out_sources = np.empty(capacity, np.int8)
    size = hybrid_tree_kernel(
        np.asarray(history, np.int64), 0, root_token, has_candidates, cand_tokens,
        cand_log_probs, vocab_size or 0, params.block_size, params.num_mask_tokens,
        params.use_esp, params.use_lookup, params.esp_log_weight,
        np.zeros((NUM_SOURCES, NUM_REACH_BUCKETS)),
        params.lookup_accept, params.mask_value, params.max_chains, capacity, False,
        out_parents, out_tokens, out_masked, out_gains, out_reach, out_sources)
    if size == 0:
        return None
    masked = tuple(out_masked[:size].tolist()) if params.use_esp else None
    spec = TreeSpec(tuple(out_parents[:size].tolist()), params.num_mask_tokens,
                    masked=masked)
    return DraftTree(spec, torch.from_numpy(out_tokens[:size].copy()))


def hybrid_next_tree(token_ids: np.ndarray, root_token: int,
                     mask_logits: torch.Tensor | None, block_size: int,
                     num_mask_tokens: int, candidates: Sequence[str],
                     esp_weight: float = ESP_WEIGHT,
                     lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                     mask_value: float = MASK_VALUE,
                     ) -> DraftTree | None:
    """The step's tree from the enabled ``candidates`` ("esp", "ngram"),
    within ``block_size`` rows.

    With "esp", nodes and ``num_mask_tokens`` masks per masked node share
    the rows (``allocate_block``). With "ngram" alone the tree is prompt
    lookup's chain of up to ``block_size - 1`` nodes, no masks. Returns None
    when no source has a candidate (with "esp" enabled that is only a step
    with no mask logits and no lookup match; ``HybridSource`` then uses
    ESP's placeholder tree).
    """
    history = np.asarray(token_ids, dtype=np.int64)
    params = HybridParams.make(block_size, num_mask_tokens, candidates,
                               esp_weight, lookup_accept, mask_value)
    cand_tokens = cand_log_probs = None
    if mask_logits is not None and params.use_esp:
        cand_tokens, cand_log_probs = mask_candidates(mask_logits, params.node_budget + 1)
    return hybrid_tree(params, history, int(root_token), cand_tokens, cand_log_probs,
                       vocab_size=None if mask_logits is None else mask_logits.shape[1])


# ------------------------------------------------------------------- batch
@njit(cache=True)
def propose_batch_kernel(mode, todo, histories, history_rows, history_starts, history_ends,
                         corpus, corpus_starts, corpus_ends, roots, has_candidates, cand_tokens,
                         cand_log_probs, vocab_size, widths, node_budget, block_sizes, num_mask_tokens, use_esp,
                         use_lookup, esp_log_weight, log_scales, bands, lookup_accept,
                         mask_values, max_chains, capacity, root_alone,
                         placeholder_parents, out_parents, out_tokens, out_masked,
                         out_num_nodes, out_gains, out_num_gains, out_reach, out_sources):
    """Next trees of the requests where ``todo``; request ``i``'s history
    is ``histories[history_rows[i], history_starts[i]:history_ends[i]]``
    (prompt lookup also searches earlier requests' answers,
    ``corpus[corpus_starts[i]:corpus_ends[i]]``)
    and its block has at most ``block_sizes[i]`` rows (hybrid mode; the
    other modes have a fixed shape and give no block where it does not
    fit). Its calibration is ``log_scales[bands[i]]`` and its mask rows'
    value ``mask_values[i]``."""
    parents = np.empty(capacity, np.int64)
    tokens = np.empty(capacity, np.int64)
    scores = np.empty(capacity, np.float32)
    depths = np.empty(capacity, np.int64)
    kept = np.empty(capacity, np.int64)
    masked = np.empty(capacity, np.bool_)
    reach = np.empty(capacity, np.float32)
    sources = np.empty(capacity, np.int8)
    gains = np.empty(max(out_gains.shape[1], 1), np.float64)
    all_masked = np.ones(capacity, np.bool_)
    k = max(num_mask_tokens, 1)
    for i in range(roots.shape[0]):
        if not todo[i]:
            continue
        size = 0
        out_num_gains[i] = 0
        if mode == HYBRID:
            history = histories[history_rows[i], history_starts[i]:history_ends[i]]
            corpus_size = corpus_ends[i] - corpus_starts[i] if use_lookup else 0
            if corpus_size > 0:
                history = np.concatenate((corpus[corpus_starts[i]:corpus_ends[i]], history))
            # Where ESP's placeholder does not fit (near max_model_len), the
            # root alone, with its masks if they fit, so that the next step
            # has candidates.
            root_alone_here = root_alone or (
                use_esp and placeholder_parents.shape[0] * (k + 1) > block_sizes[i])
            size = hybrid_tree_kernel(history, corpus_size, roots[i], has_candidates[i],
                                      cand_tokens[i], cand_log_probs[i], vocab_size,
                                      block_sizes[i], num_mask_tokens, use_esp,
                                      use_lookup, esp_log_weight, log_scales[bands[i]],
                                      lookup_accept, mask_values[i], max_chains, capacity,
                                      root_alone_here, parents, tokens, masked, gains,
                                      reach, sources)
            rows = size
            for t in range(size):
                out_parents[i, t] = parents[t]
                out_tokens[i, t] = tokens[t]
                out_masked[i, t] = masked[t]
                out_reach[i, t] = reach[t]
                out_sources[i, t] = sources[t]
                if masked[t]:
                    rows += num_mask_tokens
            if size > 0:
                out_num_gains[i] = rows - 1
                for g in range(rows - 1):
                    out_gains[i, g] = gains[g]
        elif has_candidates[i] and mode == STATIC:
            size = static_tree_kernel(cand_tokens[i], widths, roots[i], vocab_size,
                                      out_parents[i], out_tokens[i])
            for t in range(size):
                out_masked[i, t] = True
        elif has_candidates[i]:  # DYNAMIC
            count = esp_candidates_kernel(cand_tokens[i], cand_log_probs[i], node_budget,
                                          roots[i], vocab_size, parents, tokens, scores,
                                          depths)
            num_kept = select_kernel(scores, depths, count, node_budget, kept)
            size = bfs_tree_kernel(parents, tokens, depths, all_masked, kept, num_kept,
                                   out_parents[i], out_tokens[i], out_masked[i])
        fixed_shape = mode != HYBRID
        if size == 0 and use_esp:
            # ESP's placeholder: the configured shape, every token the root's.
            size = placeholder_parents.shape[0]
            fixed_shape = True
            for t in range(size):
                out_parents[i, t] = placeholder_parents[t]
                out_tokens[i, t] = roots[i]
                out_masked[i, t] = True
        if fixed_shape and size * (k + 1) > block_sizes[i]:
            size = 0  # a fixed shape that does not fit (near max_model_len)
        out_num_nodes[i] = size


class TreeProposer:
    """Next trees of a batch for one :class:`ESPConfig`.

    ``propose`` takes each request's token history (rows of a shared
    ``[R, L]`` token table, as vLLM's input batch keeps them), its root
    token (the last committed token) and its candidate table from the
    masks of its last accepted node (``mask_candidates``, ``candidate_width``
    columns; requests without one get the placeholder, or lookup alone in
    the hybrid), and fills a :class:`TreeBatch`.

    ``widths`` overrides the config's tree with a static one (the
    step-cost benchmark sizes blocks with it).

    With ``auto`` block complexity (``config.auto``), ``propose`` takes a
    :class:`~vllm_esp.core.goodput.StepBudget` and sizes every request's
    block for the step's goodput (``core.goodput``): it ranks each
    request's rows up to its cap, allocates rows across the batch, and
    builds each tree within its share (a request may get the root alone, a
    plain decoding step).
    """

    def __init__(self, config: ESPConfig, *, widths: Sequence[int] | None = None) -> None:
        from vllm_esp.core.proposal import placeholder_spec
        from vllm_esp.core.tree import static_tree

        self.config = config
        k = config.num_mask_tokens
        self.masks_per_node = config.masks_per_node
        self.hybrid = HybridParams.make(config.block_size, k, config.candidates)
        self.node_budget = config.node_budget
        self.auto = config.auto
        if config.is_hybrid or config.auto:
            self.mode = HYBRID
            self.capacity = self.hybrid.capacity
            self.max_nodes = config.block_size
            self.candidate_width = self.hybrid.node_budget + 1
            placeholder = placeholder_spec(config)
        elif widths is not None or config.tree is not None:
            self.mode = STATIC
            widths = tuple(int(w) for w in (widths if widths is not None else config.tree))
            placeholder = static_tree(widths)
            self.capacity = self.max_nodes = placeholder.num_nodes
            self.candidate_width = max(widths) + 1
        else:
            self.mode = DYNAMIC
            placeholder = placeholder_spec(config)
            self.capacity = 1 + k * self.node_budget
            self.max_nodes = config.num_nodes
            self.candidate_width = self.node_budget + 1
        self.widths = np.asarray(widths if self.mode == STATIC else (1,), np.int64)
        self.placeholder_parents = np.asarray(placeholder.parents, np.int64)
        self.max_nodes = max(self.max_nodes, placeholder.num_nodes)

    def propose(self, histories: np.ndarray, history_rows: np.ndarray,
                history_starts: np.ndarray, history_ends: np.ndarray,
                roots: np.ndarray, cand_tokens: np.ndarray, cand_log_probs: np.ndarray,
                has_candidates: np.ndarray, vocab_size: int,
                out: TreeBatch | None = None, row_caps: np.ndarray | None = None,
                budget: StepBudget | None = None,
                corpus: np.ndarray | None = None,
                corpus_rows: np.ndarray | None = None,
                corpus_spans: tuple[np.ndarray, np.ndarray] | None = None) -> TreeBatch:
        """``row_caps``: at most this many rows per request (``max_model_len``);
        ``budget``: the step's cost and calibration (``auto`` only);
        ``corpus``: earlier requests' answers for prompt lookup
        (``AnswerCorpus.tokens``), for the requests where ``corpus_rows``
        (all when None); ``corpus_spans``, instead: ``(starts, ends)``, request
        ``i`` searches ``corpus[starts[i]:ends[i]]`` (``AnswerPools.corpus``)."""
        batch = roots.shape[0]
        if out is None:
            out = TreeBatch.empty(batch, self.max_nodes, self.masks_per_node)
        block_size = (self.hybrid.block_size if self.mode == HYBRID
                      else self.max_nodes * (self.masks_per_node + 1))
        caps = np.full(batch, block_size, np.int64)
        if row_caps is not None:
            np.minimum(caps, row_caps, out=caps)
        log_scales, bands, mask_values = self._calibration(budget, batch)
        corpus = np.asarray(corpus if corpus is not None else (), histories.dtype)
        if corpus_spans is not None:
            corpus_starts, corpus_ends = (np.asarray(a, np.int64) for a in corpus_spans)
        else:
            corpus_starts = np.zeros(batch, np.int64)
            corpus_ends = np.full(batch, corpus.shape[0], np.int64)
            if corpus_rows is not None:
                corpus_ends[~np.asarray(corpus_rows, np.bool_)] = 0
        args = (histories, history_rows, history_starts, history_ends, corpus,
                corpus_starts, corpus_ends, roots,
                has_candidates, cand_tokens, cand_log_probs, vocab_size, log_scales, bands,
                mask_values, out)
        gains, num_gains = self._run(np.ones(batch, np.bool_), caps, *args)
        if self.auto and budget is not None:
            extra = allocate_rows(gains, num_gains, budget.base_rows, budget.fixed_cost,
                                  budget.cost_per_row, budget.max_total_rows,
                                  budget.cost_per_drafted_step, budget.token_values)
            # Rows are allocated as prefixes of each block's own order, so a
            # block given all its rows is already built; the others are
            # built again within their share (not cut: a cut could split a
            # group of mask rows, where the rebuild picks a node instead).
            cut = extra < num_gains
            # Given no rows, a block is the root alone: written directly, as
            # its build within one row would give it (at large batches that
            # is most requests of most steps).
            alone = cut & (extra == 0)
            if alone.any():
                out.set_roots(np.flatnonzero(alone), roots[alone])
            rebuild = cut & ~alone
            if rebuild.any():
                self._run(rebuild, np.minimum(caps, 1 + extra), *args)
        return out

    def _calibration(self, budget: StepBudget | None, batch: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The budget's calibration as the kernel takes it: log scales
        ``[NUM_SAMPLING_BANDS, NUM_SOURCES, NUM_REACH_BUCKETS]``, each
        request's band, and each request's mask rows' value."""
        bands = np.zeros(batch, np.int64)
        if budget is not None and budget.bands is not None:
            bands = np.asarray(budget.bands, np.int64)
        scales = np.ones((NUM_SOURCES, NUM_REACH_BUCKETS))
        if budget is not None and budget.scales is not None:
            scales = np.asarray(budget.scales, np.float64)
        if scales.ndim == 2:  # one calibration for every band
            scales = np.broadcast_to(scales, (NUM_SAMPLING_BANDS,) + scales.shape)
        mask_value = self.hybrid.mask_value
        if budget is not None and budget.mask_value is not None:
            mask_value = budget.mask_value
        mask_values = np.broadcast_to(np.asarray(mask_value, np.float64),
                                      (NUM_SAMPLING_BANDS,))[bands]
        return np.log(np.maximum(scales, 1e-6)), bands, mask_values

    def _run(self, todo, block_sizes, histories, history_rows, history_starts, history_ends,
             corpus, corpus_starts, corpus_ends, roots, has_candidates, cand_tokens, cand_log_probs,
             vocab_size, log_scales, bands, mask_values, out):
        hybrid = self.hybrid
        batch = roots.shape[0]
        gains = np.zeros((batch, max(hybrid.block_size - 1, 1)), np.float64)
        num_gains = np.zeros(batch, np.int64)
        propose_batch_kernel(
            self.mode, todo, histories, history_rows, history_starts, history_ends, corpus,
            corpus_starts, corpus_ends, roots,
            has_candidates, cand_tokens, cand_log_probs, vocab_size, self.widths,
            self.node_budget, block_sizes, hybrid.num_mask_tokens,
            hybrid.use_esp, hybrid.use_lookup,
            hybrid.esp_log_weight, log_scales, bands, hybrid.lookup_accept, mask_values,
            hybrid.max_chains, self.capacity, self.auto, self.placeholder_parents,
            out.parents, out.tokens, out.masked, out.num_nodes, gains, num_gains,
            out.reach, out.sources)
        return gains, num_gains


# ----------------------------------------------------------------- layouts
@dataclass
class BlockLayouts:
    """The blocks of one step (``core.tree.BlockLayout``, batched, padded
    to ``Q = max rows``): rows per block, position offsets, attention
    masks, and the rows of each node's masks (-1: none)."""

    num_rows: np.ndarray          # [B] int32
    position_offsets: np.ndarray  # [B, Q] int32
    attention_masks: np.ndarray   # [B, Q, Q] bool
    mask_rows: np.ndarray         # [B, T, k] int64
    depths: np.ndarray            # [B, T] int64


@njit(cache=True)
def layouts_kernel(parents, masked, num_nodes, num_mask_tokens, out_num_rows,
                   out_offsets, out_masks, out_mask_rows, out_depths):
    k = num_mask_tokens
    for b in range(parents.shape[0]):
        size = num_nodes[b]
        if size == 0:
            # No tree: no rows. Callers need not filter these out first.
            out_num_rows[b] = 0
            continue
        out_depths[b, 0] = 0
        for t in range(1, size):
            out_depths[b, t] = out_depths[b, parents[b, t]] + 1
        row = size
        for t in range(size):
            out_offsets[b, t] = out_depths[b, t]
            for j in range(k):
                out_mask_rows[b, t, j] = -1
            if k > 0 and masked[b, t]:
                for j in range(k):
                    out_mask_rows[b, t, j] = row + j
                    out_offsets[b, row + j] = out_depths[b, t] + j + 1
                row += k
        out_num_rows[b] = row
        # A node row sees the root, its ancestors and itself; mask j of
        # node t sees what t sees, t, and masks 1..j of t.
        for t in range(size):
            node = t
            while node >= 0:
                out_masks[b, t, node] = True
                for j in range(k):
                    if out_mask_rows[b, t, j] >= 0:
                        out_masks[b, out_mask_rows[b, t, j], node] = True
                node = parents[b, node]
            for j in range(k):
                row_j = out_mask_rows[b, t, j]
                if row_j >= 0:
                    for earlier in range(j + 1):
                        out_masks[b, row_j, out_mask_rows[b, t, earlier]] = True


def block_layouts(trees: TreeBatch) -> BlockLayouts:
    """Layouts of every tree in ``trees``; a request without a tree
    (``num_nodes == 0``) gets no rows."""
    batch, width = trees.parents.shape
    k = trees.num_mask_tokens
    max_rows = int(trees.block_sizes().max()) if batch else 1
    layouts = BlockLayouts(
        num_rows=np.zeros(batch, np.int32),
        position_offsets=np.zeros((batch, max_rows), np.int32),
        attention_masks=np.zeros((batch, max_rows, max_rows), np.bool_),
        mask_rows=np.full((batch, width, max(k, 1)), -1, np.int64),
        depths=np.zeros((batch, width), np.int64))
    layouts_kernel(trees.parents, trees.masked, trees.num_nodes, k, layouts.num_rows,
                   layouts.position_offsets, layouts.attention_masks, layouts.mask_rows,
                   layouts.depths)
    return layouts


# ------------------------------------------------------------ verification
@njit(cache=True)
def chains_kernel(parents, num_nodes, scores, score_starts, out_chains, out_lengths):
    # Node t >= 1 of block b scores scores[score_starts[b] + t - 1].
    for b in range(parents.shape[0]):
        size = num_nodes[b]
        if size == 0:
            # No tree, so no root to start the chain from.
            out_lengths[b] = 0
            continue
        start = score_starts[b] - 1
        best = np.full(size, -1, np.int64)
        for t in range(1, size):
            parent = parents[b, t]
            if best[parent] < 0 or scores[start + t] > scores[start + best[parent]]:
                best[parent] = t
        node = 0
        length = 0
        while node >= 0:
            out_chains[b, length] = node
            length += 1
            node = best[node]
        out_lengths[b] = length


def select_chains(trees: TreeBatch, child_scores: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Chain reduction for a batch (``vllm_esp_dev.verify.select_chain``): from the
    root, repeatedly go to the child with the highest target score, lowest
    node index on ties. ``child_scores[b, t]`` is the target's score
    (logit) of node ``t``'s token at its parent's row. Returns the chains
    ``[B, T]`` (node indices, root first) and their lengths (root
    included; 0 for a request without a tree)."""
    batch, width = trees.parents.shape
    scores = np.ascontiguousarray(child_scores, np.float32).reshape(-1)
    return _chains(trees, scores, np.arange(batch, dtype=np.int64) * width + 1)


def _chains(trees: TreeBatch, scores: np.ndarray, score_starts: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    batch, width = trees.parents.shape
    chains = np.zeros((batch, width), np.int64)
    lengths = np.zeros(batch, np.int64)
    chains_kernel(trees.parents, trees.num_nodes, scores, score_starts, chains, lengths)
    return chains, lengths


@njit(cache=True)
def child_score_kernel(parents, tokens, num_nodes, block_starts, out_rows, out_tokens):
    i = 0
    for b in range(parents.shape[0]):
        for t in range(1, num_nodes[b]):
            out_rows[i] = block_starts[b] + parents[b, t]
            out_tokens[i] = tokens[b, t]
            i += 1


def child_score_indices(trees: TreeBatch, block_starts: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Where each node's score is: the logits row of its parent
    (``block_starts[b]`` is block ``b``'s root row) and its token's column,
    for the non-root nodes of every block in order. Their values, flat, are
    what :func:`select_chains_flat` takes. Example: one block, parents
    ``[-1, 0, 1]``, tokens ``[5, 9, 4]``, root row 3: rows ``[3, 4]``,
    columns ``[9, 4]``."""
    total = int(np.maximum(trees.num_nodes - 1, 0).sum())
    rows = np.empty(total, np.int64)
    columns = np.empty(total, np.int64)
    child_score_kernel(trees.parents, trees.tokens, trees.num_nodes,
                       np.asarray(block_starts, np.int64), rows, columns)
    return rows, columns


def select_chains_flat(trees: TreeBatch, scores: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`select_chains` on the flat scores of the nodes that
    :func:`child_score_indices` names, in its order."""
    children = np.maximum(trees.num_nodes - 1, 0)
    score_starts = np.cumsum(children) - children
    return _chains(trees, np.asarray(scores, np.float32), score_starts)


def chain_trees(trees: TreeBatch) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`select_chains` without scores when every tree is one chain
    (node ``t``'s parent is ``t - 1``), as prompt lookup's trees are: the
    chain is the whole tree, so the step need not gather the scores.
    None when some tree branches."""
    batch, width = trees.parents.shape
    children = np.arange(1, width)
    in_tree = children[None, :] < trees.num_nodes[:, None]
    if not np.all((trees.parents[:, 1:] == children - 1) | ~in_tree):
        return None
    depths = np.arange(width, dtype=np.int64)
    chains = np.where(depths[None, :] < trees.num_nodes[:, None], depths[None, :], 0)
    return chains, trees.num_nodes.astype(np.int64)


@dataclass
class ChainRows:
    """The chains of a step as vLLM's rejection sampler takes them, over a
    step's logits in which request ``r``'s rows start at
    ``logit_starts[r]``: ESP blocks verify their chosen chain, every other
    request its own drafts. Rows are consecutive per request (drafts, then
    bonus) in ``rows`` (the compact tensor ``logits[rows]``); the
    ``*_indices`` point into the compact tensor, or, if built
    ``in_place``, into the full logits."""

    rows: np.ndarray               # [S] int64, full-logits row of each sampled row
    draft_token_ids: np.ndarray    # [D] int32, the drafts verified
    num_draft_tokens: np.ndarray   # [R] int64
    cu_num_draft_tokens: np.ndarray    # [R] int32
    cu_num_sampled_tokens: np.ndarray  # [R] int32
    target_logits_indices: np.ndarray  # [D] int32
    bonus_logits_indices: np.ndarray   # [R] int32
    logits_indices: np.ndarray         # [S] int32


@njit(cache=True)
def chain_rows_kernel(block_requests, logit_starts, vllm_num_drafts, vllm_draft_tokens,
                      chains, lengths, tree_tokens, in_place, out_rows, out_drafts,
                      out_num_drafts, out_cu_drafts, out_cu_sampled, out_target,
                      out_bonus, out_logits_indices):
    num_requests = logit_starts.shape[0]
    block_of = np.full(num_requests, -1, np.int64)
    for b in range(block_requests.shape[0]):
        block_of[block_requests[b]] = b
    row = 0
    draft = 0
    vllm_draft = 0
    for r in range(num_requests):
        b = block_of[r]
        n = vllm_num_drafts[r] if b < 0 else lengths[b] - 1
        for j in range(n + 1):
            node = j if b < 0 else chains[b, j]
            out_rows[row + j] = logit_starts[r] + node
        for j in range(n):
            if b < 0:
                out_drafts[draft + j] = vllm_draft_tokens[vllm_draft + j]
            else:
                out_drafts[draft + j] = tree_tokens[b, chains[b, j + 1]]
            out_target[draft + j] = out_rows[row + j] if in_place else row + j
        out_bonus[r] = out_rows[row + n] if in_place else row + n
        vllm_draft += vllm_num_drafts[r]
        draft += n
        row += n + 1
        out_num_drafts[r] = n
        out_cu_drafts[r] = draft
        out_cu_sampled[r] = row
    for i in range(row):
        out_logits_indices[i] = out_rows[i] if in_place else i
    return row, draft


def chain_rows(block_requests: np.ndarray, logit_starts: np.ndarray,
               vllm_num_drafts: np.ndarray, vllm_draft_tokens: np.ndarray,
               chains: np.ndarray, lengths: np.ndarray, tree_tokens: np.ndarray,
               in_place: bool) -> ChainRows:
    """The step's :class:`ChainRows`: request ``block_requests[b]`` verifies
    block ``b``'s chain ``chains[b, :lengths[b]]`` (node ids into
    ``tree_tokens[b]``; node ``i``'s logits row is ``logit_starts[r] +
    i``); every other request ``r`` its ``vllm_num_drafts[r]`` drafts
    (consecutive in ``vllm_draft_tokens``) at rows ``logit_starts[r] + 0..n``.

    Example: requests 0 and 1, logits rows starting at 0 and 3; request 0
    is a plain request with 2 drafts [7, 8]; request 1 a block whose chain
    is nodes [0, 2] (tokens [5, 9, 4]): rows ``[0, 1, 2, 3, 5]``, drafts
    ``[7, 8, 4]``, targets ``[0, 1, 3]``, bonuses ``[2, 4]`` (in place:
    targets ``[0, 1, 3]``, bonuses ``[2, 5]``)."""
    num_requests = logit_starts.shape[0]
    # Enough for any mix of chains and vLLM's drafts (the kernel does not
    # check bounds).
    capacity = int(np.asarray(vllm_num_drafts).sum() + np.asarray(lengths).sum()) + num_requests
    rows = np.empty(capacity, np.int64)
    drafts = np.empty(capacity, np.int32)
    num_drafts = np.empty(num_requests, np.int64)
    cu_drafts = np.empty(num_requests, np.int32)
    cu_sampled = np.empty(num_requests, np.int32)
    targets = np.empty(capacity, np.int32)
    bonuses = np.empty(num_requests, np.int32)
    logits_indices = np.empty(capacity, np.int32)
    num_rows, num_drafts_total = chain_rows_kernel(
        np.asarray(block_requests, np.int64), np.asarray(logit_starts, np.int64),
        np.asarray(vllm_num_drafts, np.int64), np.asarray(vllm_draft_tokens, np.int64),
        chains, lengths, tree_tokens, bool(in_place), rows, drafts,
        num_drafts, cu_drafts, cu_sampled, targets, bonuses, logits_indices)
    return ChainRows(rows[:num_rows], drafts[:num_drafts_total], num_drafts, cu_drafts,
                     cu_sampled, targets[:num_drafts_total], bonuses,
                     logits_indices[:num_rows])

